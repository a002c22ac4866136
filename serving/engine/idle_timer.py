"""Measures how long the device sits idle waiting for the host.

A daemon thread blocks on a small output of each dispatched step and stamps
its completion time. The device is idle between the completion of step k-1
and the dispatch of step k whenever the host dispatches late (or had nothing to
run); it is busy from max(dispatch of k, completion of k-1) to the completion of k.
Both add up in cumulative counters (``device_busy_s``, ``device_idle_s``, ``device_steps``:
the servers export them, so a benchmark tells a device-bound server from a host-bound
one over any interval), and the per-step timeline keeps the last ``TIMELINE_STEPS``
steps for ``bench.offline``'s per-step rooflines.
"""

import queue
import threading
import time

TIMELINE_STEPS = 100_000  # bounds the memory of a long-running server


class IdleTimer:
    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._done: dict[int, float] = {}
        self._dispatch: dict[int, float] = {}
        self._lock = threading.Lock()
        self._last_done: float | None = None
        self.busy_s = self.idle_s = 0.0
        self.steps = 0
        threading.Thread(target=self._watch, daemon=True).start()

    def on_dispatch(self, seq: int, t: float, marker) -> None:
        with self._lock:
            self._dispatch[seq] = t
        self._q.put((seq, t, marker))

    def _watch(self) -> None:
        while True:
            seq, t, marker = self._q.get()
            marker.block_until_ready()
            now = time.perf_counter()
            with self._lock:
                last = self._last_done
                if last is not None:
                    self.idle_s += max(0.0, t - last)
                self.busy_s += now - (t if last is None else max(t, last))
                self.steps += 1
                self._last_done = now
                self._done[seq] = now
                for d in (self._dispatch, self._done):
                    while len(d) > TIMELINE_STEPS:
                        d.pop(next(iter(d)))

    def counters(self) -> dict:
        """Cumulative device busy and idle seconds and completed steps since the first
        dispatch, and the idle share of that span (O(1): the servers read it every step)."""
        with self._lock:
            span = self.busy_s + self.idle_s
            return {"device_busy_s": self.busy_s, "device_idle_s": self.idle_s,
                    "device_steps": self.steps, "busy_span_s": span,
                    "host_idle_share": self.idle_s / span if span > 0 else 0.0}

    def timeline(self) -> list[tuple[int, float, float]]:
        """(seq, dispatch time, completion time) of each completed step still kept, in
        dispatch order: lets a benchmark set each step's device time against that
        step's roofline."""
        with self._lock:
            done, dispatch = dict(self._done), dict(self._dispatch)
        return [(s, dispatch[s], done[s]) for s in sorted(dispatch) if s in done]

"""Measures how long the device sits idle waiting for the host.

A daemon thread blocks on a small output of each dispatched step and stamps
its completion time. The device is idle between the completion of step k-1
and the dispatch of step k whenever the host dispatches late; the sum of those
gaps over the busy span is the host-idle share (target: under 5 %).
"""

import queue
import threading
import time


class IdleTimer:
    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._done: dict[int, float] = {}
        self._dispatch: dict[int, float] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def on_dispatch(self, seq: int, t: float, marker) -> None:
        self._dispatch[seq] = t
        self._q.put((seq, marker))

    def _watch(self) -> None:
        while True:
            seq, marker = self._q.get()
            marker.block_until_ready()
            with self._lock:
                self._done[seq] = time.perf_counter()

    def timeline(self) -> list[tuple[int, float, float]]:
        """(seq, dispatch time, completion time) of each completed step, in
        dispatch order: lets a benchmark set each step's device time against
        that step's roofline."""
        with self._lock:
            done = dict(self._done)
        return [(s, self._dispatch[s], done[s]) for s in sorted(self._dispatch) if s in done]

    def summary(self) -> dict:
        """Idle seconds and share over the span from the first dispatch to the
        last completion (call after the engine drained)."""
        with self._lock:
            done = dict(self._done)
        seqs = sorted(s for s in self._dispatch if s in done)
        if not seqs:
            return {"device_idle_s": 0.0, "busy_span_s": 0.0, "host_idle_share": 0.0}
        idle = sum(max(0.0, self._dispatch[s] - done[s - 1]) for s in seqs if s - 1 in done)
        span = done[seqs[-1]] - self._dispatch[seqs[0]]
        return {"device_idle_s": idle, "busy_span_s": span,
                "host_idle_share": idle / span if span > 0 else 0.0}

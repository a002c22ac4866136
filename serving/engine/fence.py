"""Step fence: memory released by the host returns to the pools only after
every step that was already dispatched when it was released has completed.

Why: with async scheduling the host runs one step ahead of the device. When the
host learns that request Q finished (or aborts or preempts it), a step that
still contains Q may be queued or running, and that step rewrites Q's whole
GDN state slot and appends to Q's KV blocks. If the blocks or slot were handed
to a new request R at once, and R's content arrived by a transfer that is not
ordered with the compute stream, the stale step would overwrite R's memory
(vLLM PR #45357, "race A"). So each release is tagged with the sequence number
of the last dispatched step and only applied once that step is known complete.

Completion is observed by polling `is_ready()` on a small output array of each
step (never blocking), or by `wait_all()` when the scheduler would otherwise
have to preempt for memory that is only waiting on the fence.
"""

from collections import deque
from typing import Callable


class StepFence:
    def __init__(self):
        self.dispatched = 0  # sequence number of the last dispatched step
        self.completed = 0  # every step <= this has completed on device
        self._inflight: deque = deque()  # (seq, marker array)
        self._deferred: deque = deque()  # (fence seq, release callback)

    def on_dispatch(self, marker) -> int:
        """Record a dispatched step; `marker` is one of its output arrays."""
        self.dispatched += 1
        self._inflight.append((self.dispatched, marker))
        return self.dispatched

    def mark_completed(self, seq: int) -> None:
        """The host has fetched the outputs of step `seq`, so it (and every
        earlier step, by stream order) has completed."""
        while self._inflight and self._inflight[0][0] <= seq:
            self._inflight.popleft()
        self.completed = max(self.completed, seq)
        self._drain()

    def defer(self, release: Callable[[], None]) -> None:
        """Run `release` once every step dispatched so far has completed."""
        if self.completed >= self.dispatched:
            release()
        else:
            self._deferred.append((self.dispatched, release))

    @property
    def num_pending(self) -> int:
        return len(self._deferred)

    def poll(self) -> None:
        """Apply releases whose steps have completed, without blocking."""
        while self._inflight and self._inflight[0][1].is_ready():
            self.completed = self._inflight.popleft()[0]
        self._drain()

    def wait_all(self) -> None:
        """Block until every dispatched step has completed; apply all releases."""
        while self._inflight:
            seq, marker = self._inflight.popleft()
            marker.block_until_ready()
            self.completed = seq
        self._drain()

    def _drain(self) -> None:
        while self._deferred and self._deferred[0][0] <= self.completed:
            self._deferred.popleft()[1]()

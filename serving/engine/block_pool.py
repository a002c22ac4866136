"""Paged KV block allocator with reference counts.

A block is a fixed run of `block_size` token positions of every full-attention
layer (the cache is block-major, so one id names one contiguous region that the
transfer layer can register and move). Blocks are reference counted because
more than one owner may hold a block at once: the request that computes it, and
later a transfer lease that keeps it alive while a remote worker reads it.

Allocation keeps requests in few runs of consecutive blocks: the shortest free run
that holds all `n` (best fit, which leaves the longer runs whole for later requests),
else the longest free runs until `n` are covered (the fewest runs). Consecutive blocks
are one transfer descriptor, and NIXL posts each descriptor separately (~5 to 9 µs
each on H200: a 32768-token request in shuffled blocks took 14 ms against 2.9 ms in
consecutive ones, bench/RESULTS.md), so a request that arrives by transfer should find
a run even after churn.

The pool knows nothing about steps; returning a block at the right time (after
every step that may still write it has completed) is the job of `StepFence`.
"""

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._is_free = np.ones(num_blocks, bool)
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each) in as few runs as the free blocks
        allow (see the module docstring); all or nothing."""
        if n > self._num_free:
            raise MemoryError(f"need {n} blocks, {self._num_free} free")
        free = np.flatnonzero(self._is_free)
        starts = np.concatenate(([0], np.flatnonzero(np.diff(free) != 1) + 1))
        lengths = np.diff(np.concatenate((starts, [len(free)])))
        fits = np.flatnonzero(lengths >= n)
        if len(fits):  # the shortest run that holds n; the lowest of equal ones
            r = fits[np.argmin(lengths[fits])]
            ids = free[starts[r]:starts[r] + n].tolist()
        else:  # the longest runs first
            ids = []
            for r in np.argsort(-lengths, kind="stable"):
                ids += free[starts[r]:starts[r] + min(n - len(ids), lengths[r])].tolist()
                if len(ids) == n:
                    break
        self._is_free[ids] = False
        self._num_free -= n
        for i in ids:
            self._ref[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        """Add an owner to blocks that are already held."""
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"incref of free block {i}")
            self._ref[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one owner; a block whose count reaches zero becomes allocatable."""
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._is_free[i] = True
                self._num_free += 1

    def free_ids(self) -> set[int]:
        """The allocatable blocks (for checks that no step's blocks were handed out)."""
        return set(np.flatnonzero(self._is_free).tolist())

    def ref_count(self, i: int) -> int:
        return self._ref[i]

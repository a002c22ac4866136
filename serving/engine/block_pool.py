"""Paged KV block allocator with reference counts.

A block is a fixed run of `block_size` token positions of every full-attention
layer (the cache is block-major, so one id names one contiguous region that the
transfer layer can register and move). Blocks are reference counted because
more than one owner may hold a block at once: the request that computes it, and
later a transfer lease that keeps it alive while a remote worker reads it.

The pool knows nothing about steps; returning a block at the right time (after
every step that may still write it has completed) is the job of `StepFence`.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each); all or nothing."""
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
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
                self._free.append(i)

    def ref_count(self, i: int) -> int:
        return self._ref[i]

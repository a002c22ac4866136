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

With prefix caching a block may be *cached*: its content is named by a key (the
prefix cache's hash of its tokens). A cached block whose count reaches zero is
not free but *evictable*: it keeps its content, a later request can take it back
(`touch`), and `allocate` evicts the least recently released ones only once the
free runs are used up (`on_evict` is told, so the key stops naming the block).
`num_free` counts both, since either can be handed out.

The pool knows nothing about steps; returning a block at the right time (after
every step that may still write it has completed) is the job of `StepFence`. An
evictable block got to zero through the fence like any other, so no step still
writes it; a step that reads it holds a count.
"""

import bisect
from collections import OrderedDict
from typing import Callable


class BlockPool:
    """Free blocks are kept as runs (start -> length, end -> start) with an index of
    run starts by length (each list sorted, highest first, so the lowest start pops off
    its end), so an allocation or a free touches the runs it takes or joins, not every
    block: the decode loop allocates one block per sequence every `block_size` tokens,
    and a scan of 65,536 blocks took ~0.1 ms a call (bench/RESULTS.md)."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self.on_evict = on_evict  # told of each cached block allocate reuses
        self._cached: set[int] = set()  # blocks whose content a key names
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0, LRU first
        self._num_free = 0
        self._run_at: dict[int, int] = {}      # free run start -> length
        self._run_ending: dict[int, int] = {}  # free run end (exclusive) -> start
        self._starts_by_len: dict[int, list[int]] = {}  # negated starts, ascending
        self._lengths: list[int] = []          # the keys of _starts_by_len, sorted
        self._add_run(0, num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: the free runs and the evictable blocks."""
        return self._num_free + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref count 1 each): free runs first, in as few runs as they
        allow (see the module docstring), then the least recently released evictable
        blocks; all or nothing."""
        if n > self.num_free:
            raise MemoryError(f"need {n} blocks, {self.num_free} free")
        ids: list[int] = []
        i = bisect.bisect_left(self._lengths, n)
        while len(ids) < n and self._lengths:
            # the shortest run that holds n; else the longest runs first; the lowest of
            # equal ones
            length = self._lengths[i] if i < len(self._lengths) else self._lengths[-1]
            start = -self._starts_by_len[length][-1]
            take = min(n - len(ids), length)
            self._remove_run(start, length)
            if take < length:
                self._add_run(start + take, length - take)
            ids += range(start, start + take)
        while len(ids) < n:
            b, _ = self._evictable.popitem(last=False)
            self._cached.discard(b)
            if self.on_evict is not None:
                self.on_evict(b)
            ids.append(b)
        for b in ids:
            self._ref[b] = 1
        return ids

    def mark_cached(self, i: int) -> None:
        """A key names held block `i`'s content: keep it when its count reaches zero."""
        if self._ref[i] <= 0:
            raise ValueError(f"mark_cached of free block {i}")
        self._cached.add(i)

    def is_cached(self, i: int) -> bool:
        return i in self._cached

    def uncache_all(self) -> None:
        """Forget every block's key (its content is gone): evictable blocks become free."""
        evictable = sorted(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        for b in evictable:
            self._join(b, b + 1)

    def touch(self, ids: list[int]) -> None:
        """Add an owner to cached blocks, held or evictable (a prefix-cache hit)."""
        for i in ids:
            if i not in self._cached:
                raise ValueError(f"touch of block {i}, which is not cached")
        for i in ids:
            self._evictable.pop(i, None)
            self._ref[i] += 1

    def incref(self, ids: list[int]) -> None:
        """Add an owner to blocks that are already held; all or nothing."""
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"incref of free block {i}")
        for i in ids:
            self._ref[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one owner; a block whose count reaches zero becomes allocatable: evictable
        if cached (the last of `ids` first in line for eviction, since a later block of
        a prefix is useless without the earlier ones), else free. All or nothing: a
        block freed more often than it is held raises before any changes."""
        for n, i in enumerate(ids):
            if self._ref[i] <= 0:
                for j in ids[:n]:  # undo, so nothing changed
                    self._ref[j] += 1
                raise ValueError(f"double free of block {i}")
            self._ref[i] -= 1
        released = set()
        for i in reversed(ids):
            if self._ref[i] == 0:
                if i in self._cached:
                    self._evictable[i] = None
                else:
                    released.add(i)
        start = prev = -2  # each stretch of consecutive blocks joins its neighbours
        for b in sorted(released):
            if b != prev + 1:
                if prev >= 0:
                    self._join(start, prev + 1)
                start = b
            prev = b
        if prev >= 0:
            self._join(start, prev + 1)

    def free_ids(self) -> set[int]:
        """The allocatable blocks (for checks that no step's blocks were handed out)."""
        free = {b for start, length in self._run_at.items() for b in range(start, start + length)}
        return free | set(self._evictable)

    def ref_count(self, i: int) -> int:
        return self._ref[i]

    def _join(self, a: int, b: int) -> None:
        """Make blocks [a, b) free, merged with the free runs that touch them."""
        if a in self._run_ending:
            left = self._run_ending[a]
            self._remove_run(left, a - left)
            a = left
        if b in self._run_at:
            length = self._run_at[b]
            self._remove_run(b, length)
            b += length
        self._add_run(a, b - a)

    def _add_run(self, start: int, length: int) -> None:
        self._run_at[start] = length
        self._run_ending[start + length] = start
        starts = self._starts_by_len.get(length)
        if starts is None:
            starts = self._starts_by_len[length] = []
            bisect.insort(self._lengths, length)
        bisect.insort(starts, -start)
        self._num_free += length

    def _remove_run(self, start: int, length: int) -> None:
        del self._run_at[start], self._run_ending[start + length]
        starts = self._starts_by_len[length]
        if starts[-1] == -start:  # the lowest start: allocation's usual case
            starts.pop()
        else:
            del starts[bisect.bisect_left(starts, -start)]
        if not starts:
            del self._starts_by_len[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        self._num_free -= length

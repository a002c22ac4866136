"""Prefix caching for the hybrid cache: shared KV blocks and GDN state snapshots.

Attention KV is a range: a full block's content depends only on the tokens up to
its end, so a block is named by a hash chain over token blocks (each key hashes
the previous key and the block's token ids, the first is seeded with the model's
identity) and a request whose prompt starts with the same blocks shares them,
read-only. GDN state is a point: the state after position L depends on every
token before L and nothing else, so the engine keeps *snapshots* of it at some
block boundaries, each named by the key of the block that ends there, in state
rows of their own after the request slots (`rows`).

A hit is the longest L = j * block_size below the request's token count such that
blocks 0..j-1 are cached and the state after block j-1 is snapshotted: the request
takes those blocks, starts its GDN state from the snapshot row and computes tokens
from L on, in blocks of its own; so no shared block is ever written, and the last
partial block is never shared. Snapshots are taken where a prefill step passes
them, as many as the step's bucket has room for (`per_step`), in this order: where
the request leaves the cached prompt it matched and where requests waiting now leave
it (each serves every later prompt of that shared prefix), the last block boundaries
of its known tokens (the two that a repeat of the same prompt and a longer follow-up
can hit), then every `interval` blocks.

Safety, by stream order: a block is registered when the step that writes its last
token is scheduled, and a snapshot when the step that emits it is; every reader is
a later step (registrations become visible after the scheduling pass that makes
them), and a cached block is handed to another request only when no one holds it
(`BlockPool`), so no step can still write it. Snapshot rows are written and read
only by steps, so a row evicted and rewritten for another prefix is rewritten
after every step that read it has run: rows need no reference counts, only an
LRU. Content depends only on the tokens, so a step that runs after its request was
preempted or aborted still writes what its key names.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from serving.engine.block_pool import BlockPool
from serving.engine.request import Request


def block_key(prev: bytes, tokens) -> bytes:
    """The key of a block of `tokens` whose prefix has key `prev` (the chain's seed for the
    first block)."""
    return hashlib.blake2b(prev + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def model_identity(*parts) -> bytes:
    """The seed of every hash chain: prefixes of different models or dtypes never match."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class SnapshotRows:
    """State rows [first, first + n) of the cache's conv/ssm arrays holding snapshots, by
    key, evicted least recently used first."""

    def __init__(self, first: int, n: int):
        self.first, self.n = first, n
        self._row: OrderedDict[bytes, int] = OrderedDict()  # key -> row, LRU first
        self._unused = list(range(first + n - 1, first - 1, -1))

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, key: bytes) -> bool:
        return key in self._row

    def get(self, key: bytes) -> int | None:
        row = self._row.get(key)
        if row is not None:
            self._row.move_to_end(key)
        return row

    def take(self, key: bytes) -> int:
        """A row for a new snapshot named `key`, which has none (an unused one, else the
        LRU's)."""
        row = self._unused.pop() if self._unused else self._row.popitem(last=False)[1]
        self._row[key] = row
        return row


class PrefixCache:
    def __init__(self, blocks: BlockPool, *, block_size: int, interval: int, rows: SnapshotRows,
                 per_step, identity: bytes):
        """`per_step(num_tokens, num_seqs)`: the snapshots a prefill step can hold."""
        if interval < 1:
            raise ValueError(f"prefix state interval must be >= 1 block, got {interval}")
        self.blocks, self.block_size, self.interval = blocks, block_size, interval
        self.rows, self.per_step, self.identity = rows, per_step, identity
        self._block: dict[bytes, int] = {}  # key -> cached block
        self._key: dict[int, bytes] = {}  # cached block -> key
        self._staged: list[tuple[bytes, int]] = []  # block registrations of this pass
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found cached

    def clear(self) -> None:
        """Forget every cached prefix (the cache arrays were replaced)."""
        self.blocks.uncache_all()
        self._block.clear()
        self._key.clear()
        self.rows = SnapshotRows(self.rows.first, self.rows.n)

    def on_evict(self, block: int) -> None:
        """BlockPool's callback: `block` is being reused, its key names nothing now."""
        del self._block[self._key.pop(block)]

    # ---- keys ----------------------------------------------------------------

    def keys(self, req: Request, num_tokens: int) -> list[bytes]:
        """The keys of `req`'s full blocks among its first `num_tokens` known tokens,
        extending the chain the request keeps."""
        bs, have = self.block_size, req.block_keys
        n = min(num_tokens, req.num_known_tokens) // bs
        for j in range(len(have), n):
            prev = have[-1] if have else self.identity
            have.append(block_key(prev, req.token_slice(j * bs, (j + 1) * bs)))
        return have[:n]

    # ---- lookup --------------------------------------------------------------

    def match(self, req: Request) -> tuple[list[int], int | None]:
        """The cached blocks and the snapshot row of `req`'s longest hit (see the module
        docstring); the blocks gain `req` as an owner. ([], None) for no hit. Where more
        of its blocks are cached than the hit covers, `req` diverges from a cached prompt
        at the end of those blocks: its prefill takes a snapshot there
        (`req.divergence`), so the next prompt sharing that prefix hits all of it."""
        limit = (req.num_tokens - 1) // self.block_size  # leave a token to compute
        keys = self.keys(req, limit * self.block_size)
        found = []
        for key in keys:
            b = self._block.get(key)
            if b is None:
                break
            found.append(b)
        req.divergence = len(found) * self.block_size if found else None
        for j in range(len(found), 0, -1):
            row = self.rows.get(keys[j - 1])
            if row is not None:
                self.blocks.touch(found[:j])
                return found[:j], row
        return [], None

    def cached_tokens(self, req: Request) -> int:
        """The tokens `match` would let `req` skip now, taking nothing (no owner added,
        no LRU touched): how the scheduler ranks waiting requests."""
        limit = (req.num_tokens - 1) // self.block_size
        keys = self.keys(req, limit * self.block_size)
        j = 0
        while j < len(keys) and keys[j] in self._block:
            j += 1
        while j > 0 and keys[j - 1] not in self.rows:
            j -= 1
        return j * self.block_size

    def match_blocks(self, req: Request, num_tokens: int) -> list[int]:
        """The cached blocks that hold the start of `req`'s first `num_tokens` tokens, with
        `req` added as their owner: for a request whose state arrives by a transfer (the
        decode side), which needs no snapshot and pulls only the blocks after these."""
        found = []
        for key in self.keys(req, num_tokens):
            b = self._block.get(key)
            if b is None:
                break
            found.append(b)
        self.blocks.touch(found)
        return found

    def count(self, num_queried: int, num_hit: int) -> None:
        self.queries += num_queried
        self.hits += num_hit

    # ---- registration --------------------------------------------------------

    def stage_blocks(self, req: Request, num_written: int) -> None:
        """Register `req`'s blocks that the step being scheduled (or an earlier one)
        fills, up to `num_written` tokens, as far as their tokens are known; none while
        the bytes a transfer landed in them are unconfirmed (`transfer_unconfirmed`)."""
        if req.transfer_unconfirmed:
            return
        keys = self.keys(req, num_written)
        for j in range(req.num_registered_blocks, len(keys)):
            self._staged.append((keys[j], req.block_ids[j]))
        req.num_registered_blocks = max(req.num_registered_blocks, len(keys))

    def snapshot_points(self, req: Request, start: int, num_tokens: int,
                        waiting=()) -> list[int]:
        """Block boundaries L in (start, start + num_tokens] a prefill chunk passes and
        whose state is worth a snapshot, best first: where the request diverges from a
        cached prompt and where the `waiting` requests part from it, its last ones,
        then every `interval` blocks, the latest first."""
        bs = self.block_size
        known = req.num_known_tokens
        hi = min(start + num_tokens, known) // bs
        lo = start // bs + 1
        keys = self.keys(req, hi * bs)
        marks = ((req.divergence or 0) // bs, *self._partings(keys, lo, waiting),
                 known // bs, (known - 1) // bs)
        ends = list(dict.fromkeys(j for j in marks if lo <= j <= hi))
        every = [j for j in range(hi, lo - 1, -1) if j % self.interval == 0 and j not in ends]
        return [j * bs for j in ends + every if j >= 1 and keys[j - 1] not in self.rows]

    def _partings(self, keys: list[bytes], lo: int, waiting) -> list[int]:
        """Block counts >= `lo` at which waiting requests' prompts part from the chain
        `keys`: a burst of prompts sharing a prefix then hits all of it once the first
        one's step has run, instead of the last `interval` mark before it."""
        out = set()
        for other in waiting if keys else ():
            if self.keys(other, self.block_size)[:1] != keys[:1]:
                continue
            theirs = self.keys(other, min(len(keys), (other.num_tokens - 1) // self.block_size)
                               * self.block_size)
            j = next((i for i, (a, b) in enumerate(zip(keys, theirs)) if a != b),
                     min(len(keys), len(theirs)))
            if j >= lo:
                out.add(j)
        return sorted(out, reverse=True)

    def snapshot_row(self, req: Request, position: int) -> int | None:
        """A row for the snapshot of `req`'s state at block boundary `position`, or None
        where its key has one: another sequence of this pass computes the same prefix
        and took it first (`snapshot_points` leaves out keys with rows before the pass's
        takes). Called after the pass's lookups, so the pass's own steps never read it."""
        key = req.block_keys[position // self.block_size - 1]
        return None if key in self.rows else self.rows.take(key)

    def commit(self) -> None:
        """Make this pass's block registrations visible to later passes' lookups. A block
        whose key already names another block (the same prefix computed twice) stays
        private."""
        for key, block in self._staged:
            if key not in self._block and self.blocks.ref_count(block) > 0:
                self._block[key], self._key[block] = block, key
                self.blocks.mark_cached(block)
        self._staged.clear()

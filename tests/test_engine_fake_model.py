"""A tiny stand-in for the model with the same forward(batch, cache) contract,
for fast engine tests (hundreds of requests in seconds on CPU).

It is not a neural network, but it exercises every piece of memory plumbing
the engine relies on: the next token is a function of
  * all earlier tokens, read back through the block table from paged "KV"
    (so a wrong block id, a lost write or a stale block changes the output), and
  * a recurrent hash kept in the request's state slot, continued across chunks
    from `start_pos > 0` (read from `init_slots`, a prefix snapshot on a hit) and
    started from zero when `start_pos == 0` without reading the slot (so a wrong
    slot or a missed state write changes it too), with snapshots of the hash
    stored at `snapshot_ends` as the GDN layers store theirs.
`reference_next` computes the same next token for a whole sequence in numpy.
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MOD = 1_000_003


@jax.tree_util.register_dataclass
@dataclass
class FakeBatch:
    tokens: jax.Array
    cu_seqlens: jax.Array
    start_pos: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    logits_indices: jax.Array
    init_slots: jax.Array
    snapshot_ends: jax.Array
    snapshot_slots: jax.Array
    is_decode: bool = field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass
class FakeCache:
    kv: jax.Array  # i32 [num_blocks, block_size]: the token at each position
    ssm: jax.Array  # i32 [num_slots]: the recurrent hash

    @property
    def block_nbytes(self) -> int:
        return self.kv.nbytes // self.kv.shape[0]

    @property
    def slot_nbytes(self) -> int:
        return self.ssm.nbytes // self.ssm.shape[0]

    @staticmethod
    def allocate(num_blocks: int, block_size: int, num_slots: int) -> "FakeCache":
        # Garbage, not zeros: nothing may rely on fresh memory being zeroed.
        return FakeCache(jnp.full((num_blocks, block_size), 12345, jnp.int32),
                         jnp.full((num_slots,), 777, jnp.int32))


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int


class FakeModel(nnx.Module):
    def __init__(self, vocab: int = 101):
        self.vocab = vocab
        self.config = FakeConfig(vocab)
        self.scale = nnx.Param(jnp.float32(0.5))

    def forward(self, batch: FakeBatch, cache: FakeCache):
        t, n = batch.tokens.shape[0], batch.start_pos.shape[0]
        nb, bs = cache.kv.shape
        cu = batch.cu_seqlens
        idx = jnp.arange(t)
        valid = idx < cu[n]
        seg = jnp.minimum(jnp.searchsorted(cu[1:], idx, side="right"), n - 1)
        pos = batch.start_pos[seg] + idx - cu[seg]
        blk = batch.block_tables[seg, jnp.clip(pos // bs, 0, batch.block_tables.shape[1] - 1)]
        kv = cache.kv.at[jnp.where(valid, blk, nb), pos % bs].set(batch.tokens, mode="drop")
        num_slots = cache.ssm.shape[0]
        h0 = jnp.where(batch.start_pos > 0,
                       cache.ssm[jnp.minimum(batch.init_slots, num_slots - 1)], 0)

        def body(h, i):
            s = seg[i]
            h = h.at[s].set(jnp.where(valid[i], (h[s] * 31 + batch.tokens[i]) % MOD, h[s]))
            return h, h[s]

        h, after = jax.lax.scan(body, h0, idx)  # after[i]: the hash after token i
        ssm = cache.ssm.at[batch.slots].set(h, mode="drop")
        if batch.snapshot_ends.shape[0]:
            snaps = after[jnp.maximum(batch.snapshot_ends - 1, 0)]
            ssm = ssm.at[batch.snapshot_slots].set(snaps, mode="drop")
        length = batch.start_pos + cu[1:] - cu[:-1]
        p = jnp.arange(batch.block_tables.shape[1] * bs)
        toks = kv[batch.block_tables[:, p // bs], p % bs]  # [N, P]
        a = jnp.sum(jnp.where(p[None] < length[:, None], toks * (p + 1), 0), axis=1) % MOD
        target = (a + 7 * h) % self.vocab
        dist = (jnp.arange(self.vocab)[None] - target[:, None]) % self.vocab
        logits = -dist.astype(jnp.float32) * self.scale[...]
        return logits, FakeCache(kv, ssm)


def reference_next(tokens: list[int], vocab: int = 101) -> int:
    h = 0
    for x in tokens:
        h = (h * 31 + x) % MOD
    a = sum(x * (p + 1) for p, x in enumerate(tokens)) % MOD
    return (a + 7 * h) % vocab


def reference_greedy(prompt: list[int], max_tokens: int, vocab: int = 101,
                     eos: tuple[int, ...] = ()) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(reference_next(seq, vocab))
        seq.append(out[-1])
        if out[-1] in eos:
            break
    return out

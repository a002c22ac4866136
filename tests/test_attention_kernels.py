"""Paged attention kernels against a float64 NumPy oracle written from the definition.

The Pallas kernel body runs here in interpret mode (backend="interpret") with
the CPU tile table (small tiles, so every case walks several query and key
tiles, both causal loops and, for decode, several key splits).  Interpret mode
fills unwritten outputs with NaN, and NaN never passes; padding tokens must
come back exactly 0.  Caches, block tables (random permutations, so logical
and physical block order differ) and queries are random per case.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.attention import paged_attention, paged_attention_reference
from pallas_kernels.attention.pallas_triton import query_tiles
from pallas_kernels.oracle import paged_attention_oracle, rel_err

HD = 32
LAYERS = 2
TOL = {"float32": 1e-4, "bfloat16": 1e-2}


def make_step(rng, lens, ctx, *, heads, kv_heads, block_size, dtype, pad_tokens=0):
    """A packed step: sequence n has ctx[n] cached tokens and lens[n] new ones.

    Returns the op's arguments plus the per-token validity mask.  seq_ids and
    positions follow qwen35_jax.batch.step_meta: padding tokens get the last
    sequence (clipped) and position 0.
    """
    lens, ctx = np.asarray(lens), np.asarray(ctx)
    n = len(lens)
    total = ctx + lens
    m = max(1, int(-(-total.max() // block_size)))
    num_blocks = n * m + 3
    perm = rng.permutation(num_blocks)[:n * m].reshape(n, m).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1]) + pad_tokens
    tok = np.arange(t)
    seq = np.minimum(np.searchsorted(cu[1:], tok, side="right"), n - 1).astype(np.int32)
    valid = tok < cu[-1]
    pos = np.where(valid, ctx[seq] + tok - cu[seq], 0).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, heads, HD)), dtype)
    kv = jnp.asarray(rng.standard_normal((num_blocks, LAYERS, 2, block_size, kv_heads, HD)), dtype)
    return dict(q=q, kv=kv, block_tables=perm, seq_ids=seq, positions=pos, cu=cu, valid=valid)


def _oracle(st, layer):
    f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    return paged_attention_oracle(f(st["q"]), f(st["kv"]), layer, st["block_tables"],
                                  st["seq_ids"], st["positions"], HD ** -0.5, st["valid"])


def _run(st, layer, *, is_decode=False, backend="interpret", config=None):
    fn = jax.jit(lambda q, kv, lay, bt, sid, pos, cu: paged_attention(
        q, kv, lay, bt, sid, pos, scale=HD ** -0.5, cu_seqlens=cu, is_decode=is_decode,
        backend=backend, config=config))
    return fn(st["q"], st["kv"], jnp.int32(layer), jnp.asarray(st["block_tables"]),
              jnp.asarray(st["seq_ids"]), jnp.asarray(st["positions"]), jnp.asarray(st["cu"]))


def _check(out, st, layer, dtype):
    want = _oracle(st, layer)
    got = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "unwritten or non-finite output"
    err = rel_err(got[st["valid"]], want[st["valid"]])
    assert err <= TOL[dtype], err
    assert np.all(got[~st["valid"]] == 0.0), "padding tokens must be 0"


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# (lens, cached context per sequence, heads, kv_heads, block_size, dtype, pad_tokens)
PREFILL_CASES = [
    ([1, 63, 0, 64, 65, 200], [0] * 6, 4, 2, 16, "float32", 7),      # fresh, GQA 2
    ([200, 65, 1], [0, 0, 0], 8, 1, 64, "bfloat16", 5),               # fresh, GQA 8
    ([5, 64, 1, 70], [0, 37, 64, 130], 2, 2, 16, "float32", 0),        # continuing, MHA
    ([63, 33, 0, 2], [1, 64, 9, 199], 4, 2, 64, "bfloat16", 3),       # continuing, GQA 2
    ([40, 17], [23, 0], 6, 2, 16, "float32", 2),                       # group 3 (padded to 4)
]


@pytest.mark.parametrize("lens,ctx,heads,kv_heads,block_size,dtype,pad", PREFILL_CASES)
def test_prefill_matches_oracle(lens, ctx, heads, kv_heads, block_size, dtype, pad):
    rng = _rng("prefill", lens, ctx, heads, kv_heads, block_size, dtype)
    st = make_step(rng, lens, ctx, heads=heads, kv_heads=kv_heads, block_size=block_size,
                   dtype=jnp.dtype(dtype), pad_tokens=pad)
    layer = int(rng.integers(LAYERS))
    _check(_run(st, layer), st, layer, dtype)


# (context lengths incl. the new token, 0 = padding row; heads, kv_heads, block, dtype, splits)
DECODE_CASES = [
    ([1, 63, 64, 65, 200, 0], 2, 2, 16, "float32", None),   # the tuning table's split rule
    ([1, 63, 64, 65, 200, 0], 8, 1, 64, "bfloat16", 1),
    ([130, 7, 0, 64], 4, 2, 16, "bfloat16", 3),
    ([300, 2], 8, 1, 16, "float32", 4),
]


@pytest.mark.parametrize("ctx_len,heads,kv_heads,block_size,dtype,splits", DECODE_CASES)
def test_decode_matches_oracle(ctx_len, heads, kv_heads, block_size, dtype, splits):
    rng = _rng("decode", ctx_len, heads, kv_heads, block_size, dtype, splits)
    ctx_len = np.asarray(ctx_len)
    lens = (ctx_len > 0).astype(int)
    st = make_step(rng, lens, np.maximum(ctx_len - 1, 0), heads=heads, kv_heads=kv_heads,
                   block_size=block_size, dtype=jnp.dtype(dtype))
    # decode rows: token i is sequence i (T == N); empty sequences are padding rows
    n = len(ctx_len)
    st["seq_ids"] = np.arange(n, dtype=np.int32)
    st["positions"] = np.maximum(ctx_len - 1, 0).astype(np.int32)
    st["valid"] = ctx_len > 0
    st["q"] = jnp.asarray(rng.standard_normal((n, heads, HD)), jnp.dtype(dtype))
    layer = int(rng.integers(LAYERS))
    cfg = None if splits is None else {"splits": splits}
    _check(_run(st, layer, is_decode=True, config=cfg), st, layer, dtype)


@pytest.mark.parametrize("dtype,splits", [("float32", None), ("bfloat16", 2)])
def test_decode_of_a_verify_step_matches_oracle(dtype, splits):
    """The decode kernel over a verify step's tokens: up to k + 1 a sequence, packed
    (T = 3 N here), each attending causally up to its own position; rows past cu[N]
    are padding."""
    rng = _rng("verify", dtype, splits)
    lens, ctx = [3, 1, 2, 0], [40, 7, 64, 0]
    st = make_step(rng, lens, ctx, heads=4, kv_heads=2, block_size=16,
                   dtype=jnp.dtype(dtype), pad_tokens=3 * len(lens) - sum(lens))
    cfg = None if splits is None else {"splits": splits}
    _check(_run(st, 1, is_decode=True, config=cfg), st, 1, dtype)


def test_reference_matches_oracle():
    """The CPU path (and the kernels' in-framework reference) on a packed, continuing step."""
    rng = _rng("reference")
    st = make_step(rng, [3, 40, 17], [5, 0, 64], heads=4, kv_heads=2, block_size=16,
                   dtype=jnp.float32)
    out = paged_attention_reference(st["q"], st["kv"], 1, jnp.asarray(st["block_tables"]),
                                    jnp.asarray(st["seq_ids"]), jnp.asarray(st["positions"]),
                                    scale=HD ** -0.5)
    want = _oracle(st, 1)
    assert rel_err(np.asarray(out, np.float64), want) <= TOL["float32"]


def test_query_tiles_cover_each_token_once_within_one_sequence():
    cu = np.array([0, 5, 5, 37, 40], np.int32)
    t, bq = 46, 8
    seq, start, length = (np.asarray(a) for a in query_tiles(jnp.asarray(cu), t, bq))
    assert len(seq) == -(-t // bq) + len(cu)
    covered = np.zeros(t, int)
    for s, a, n in zip(seq, start, length):
        assert 0 <= n <= bq
        covered[a:a + n] += 1
        if n and s >= 0:
            assert cu[s] <= a and a + n <= cu[s + 1]
        elif n:  # the padding tail
            assert a >= cu[-1]
    assert np.all(covered == 1)

"""Flash attention over the paged KV cache (Pallas, Triton backend).

One kernel body serves fresh prefill chunks, chunks that continue cached
context, and decode.  The reference gathers each query token's whole sequence
of keys ([T, L, KV, hd]); at 8192 tokens x 8192 keys that is far beyond any
GPU's memory, so the kernel instead walks its sequence's keys tile by tile
through the block table with an online softmax in float32.

Work decomposition.  A program owns one *query tile* (``bq`` consecutive
tokens of ONE sequence, from a table built on device from ``cu_seqlens``) and
one KV head.  The GQA group of that KV head is folded into the matmul M
dimension: row r of the [bq * gpad, hd] query block is token ``r // gpad``,
query head ``kv_head * group + r % gpad`` (``gpad`` = group padded to a power
of two; rows past the group are masked), so each key/value tile loaded from the
cache feeds every query head that shares it.  Prefill uses gpad = next power
of two of the group and bq = bm // gpad tokens; decode has one token per
sequence, so bq = 1 and the group is padded to 16 rows, the smallest
``tl.dot`` M.

Key loop.  Key tile j holds positions [j*bk, (j+1)*bk); each key row's cache
row is found through the block table (a gather of bk block ids), so bk and
the cache block size are independent.  Tiles entirely at or before the tile's
first query position need no causal mask (first loop); the rest, up to the
last query position, are masked per row (second loop).  Decode can split the
key range over ``n_split`` programs (split-K) that write unnormalised partial
results and their (max, sum) for a small combine in JAX, so that batches with
few sequences still fill the GPU.

Numerics follow the reference: scores and softmax statistics in float32, the
probabilities cast to the activation dtype before the value product (bf16
operands, fp32 accumulation on tensor cores; float32 inputs use IEEE fp32
products).  Padding tokens (index >= cu_seqlens[N]) and padding decode rows get
0 instead of the reference's attention over the clipped sequence's first key:
their outputs are never used, and zeros keep them finite.

All memory access goes through explicit index vectors with masks (the Triton
backend turns them into pointer tensors; interpret mode into clamped gathers),
so no access can run past an array in either mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Pallas Triton backend (deprecated from jax 0.11, still shipped)
    from jax.experimental.pallas import triton as plt
except Exception:  # pragma: no cover
    plt = None

from ..gdn.reference import chunk_table

_HI = lax.Precision.HIGHEST
_M_INIT = -1e30  # finite: a row whose keys are all masked in a tile keeps alpha = 1


def _next_pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


def _mm(a, b, *, tb=False):
    """2-D matmul with fp32 accumulation; IEEE fp32 for float32 operands."""
    prec = _HI if a.dtype == jnp.float32 else None
    dn = (((1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=prec, preferred_element_type=jnp.float32)


def _attn_kernel(tseq_ref, tstart_ref, tlen_ref, layer_ref, bt_ref, pos_ref, q_ref, kv_ref,
                 *out_refs, bq, gpad, group, heads, kv_heads, layers, block_size, bt_cols,
                 bk, scale, n_split, n_tiles, reverse):
    pid = pl.program_id(0)
    i = n_tiles - 1 - pid if reverse else pid  # prefill: longest (last) tiles first
    h = pl.program_id(1)
    s = pl.program_id(2)
    rows_total = q_ref.shape[0]
    T = rows_total // heads
    hd = q_ref.shape[1]
    bm = bq * gpad

    seq = tseq_ref[i]
    start = tstart_ref[i]
    n = tlen_ref[i]
    layer = layer_ref[0]

    r = lax.broadcasted_iota(jnp.int32, (bm,), 0)
    tok_off = r // gpad
    grp = r % gpad
    tok_ok = tok_off < n
    row_ok = tok_ok & (grp < group)
    tok = jnp.minimum(start + tok_off, T - 1)
    qrow = tok * heads + h * group + jnp.minimum(grp, group - 1)
    col = lax.broadcasted_iota(jnp.int32, (hd,), 0)
    q = plt.load(q_ref.at[qrow[:, None], col[None, :]], mask=row_ok[:, None], other=0.0)
    qpos = plt.load(pos_ref.at[tok], mask=tok_ok, other=0)

    active = (seq >= 0) & (n > 0)
    p_first = pos_ref[jnp.clip(start, 0, T - 1)]
    p_last = pos_ref[jnp.clip(start + n - 1, 0, T - 1)]
    n_kv = jnp.where(active, p_last // bk + 1, 0)      # tiles up to the last query
    n_full = jnp.where(active, (p_first + 1) // bk, 0)  # tiles every query sees whole
    per = (n_kv + n_split - 1) // n_split
    lo = s * per
    hi = jnp.minimum(lo + per, n_kv)
    seq_c = jnp.maximum(seq, 0)
    kidx = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    p_dtype = q.dtype

    def tile(j, carry, masked):
        m, l, acc = carry
        kpos = j * bk + kidx
        # keys past the tile's last query are never read (their blocks may not exist)
        kmask = (kpos <= p_last) if masked else None
        blk_col = jnp.minimum(kpos // block_size, bt_cols - 1)
        blk = plt.load(bt_ref.at[seq_c * bt_cols + blk_col], mask=kmask,
                       other=0 if masked else None)
        krow = ((blk * layers + layer) * 2 * block_size + kpos % block_size) * kv_heads + h
        vrow = krow + block_size * kv_heads
        lmask = kmask[:, None] if masked else None
        other = 0.0 if masked else None
        k = plt.load(kv_ref.at[krow[:, None], col[None, :]], mask=lmask, other=other)
        v = plt.load(kv_ref.at[vrow[:, None], col[None, :]], mask=lmask, other=other)
        sc = _mm(q, k.astype(q.dtype), tb=True) * scale
        if masked:
            sc = jnp.where(kpos[None, :] <= qpos[:, None], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mm(p.astype(p_dtype), v.astype(p_dtype))
        return m_new, l, acc

    carry = (jnp.full((bm,), _M_INIT, jnp.float32), jnp.zeros((bm,), jnp.float32),
             jnp.zeros((bm, hd), jnp.float32))
    mid = jnp.clip(n_full, lo, hi)
    carry = lax.fori_loop(lo, mid, functools.partial(tile, masked=False), carry)
    m, l, acc = lax.fori_loop(mid, hi, functools.partial(tile, masked=True), carry)

    # Masked-off rows get distinct out-of-range indices: the GPU never touches
    # them, and interpret mode (a scatter that drops out-of-range rows) then has
    # no duplicate index that could overwrite a valid row with its old value.
    spare = n_split * rows_total + r
    if n_split == 1:
        (o_ref,) = out_refs
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        orow = jnp.where(row_ok, qrow, spare)
        plt.store(o_ref.at[orow[:, None], col[None, :]], o.astype(o_ref.dtype),
                  mask=row_ok[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        prow = jnp.where(row_ok, s * rows_total + qrow, spare)
        plt.store(acc_ref.at[prow[:, None], col[None, :]], acc, mask=row_ok[:, None])
        plt.store(m_ref.at[prow], m, mask=row_ok)
        plt.store(l_ref.at[prow], l, mask=row_ok)


def _compiler_params(num_warps, num_stages):
    if plt is None:  # pragma: no cover
        return None
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def query_tiles(cu_seqlens, num_tokens, bq):
    """(seq, start, length) of query tiles of at most ``bq`` tokens of one sequence.

    Static length ceil(T / bq) + N + 1: the tokens past cu[N] form one more
    "sequence" (seq -1) whose tiles write zeros, so every token row is written;
    unused entries have length 0.  Computed on device from traced cu_seqlens,
    so one compiled program serves every batch of its bucket.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n = cu.shape[0] - 1
    cu_ext = jnp.concatenate([cu, jnp.full((1,), num_tokens, jnp.int32)])
    tab = chunk_table(cu_ext, num_tokens, bq)
    seq = jnp.where(tab["seq"] < n, tab["seq"], -1)
    return seq, tab["start"], tab["length"]


def decode_tiles(num_tokens, seq_ids, cu_seqlens):
    """One tile per decode row; a padding row gets seq -1: with one row a sequence, the
    row of an empty sequence; with more (a verify step's tokens, packed), a row past
    cu[N]."""
    start = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.asarray(seq_ids, jnp.int32)
    if cu_seqlens is not None:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        live = cu[1:] > cu[:-1] if num_tokens == cu.shape[0] - 1 else start < cu[-1]
        seq = jnp.where(live, seq, -1)
    return seq, start, jnp.ones((num_tokens,), jnp.int32)


def _combine(acc, m, l, out_dtype):
    """Merges split-K partials: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s."""
    mx = jnp.max(m, axis=0)
    w = jnp.exp(m - mx[None])
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * acc, axis=0)
    return (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(out_dtype)


def paged_attention_pallas(q, kv, layer, block_tables, seq_ids, positions, *, scale,
                           cu_seqlens=None, is_decode=False, interpret=False, config=None):
    """Pallas paged attention; the interface and contract of ``ops.paged_attention``."""
    from ..tuning import attention_config
    T, H, hd = q.shape
    nb, L, two, bs, KV, hd_k = kv.shape
    if two != 2 or hd_k != hd or H % KV:
        raise ValueError(f"q {q.shape} does not match the cache {kv.shape}")
    if hd & (hd - 1):
        raise ValueError(f"head_dim {hd} must be a power of two for the kernel")
    N, M = block_tables.shape
    group = H // KV
    cfg = attention_config(is_decode, q.dtype)
    if config:
        cfg.update(config)
    bk = int(cfg["bk"])
    if is_decode:
        gpad = max(16, _next_pow2(group))
        bq = 1
        tseq, tstart, tlen = decode_tiles(T, seq_ids, cu_seqlens)
        n_split = cfg.get("splits")
        if n_split is None:  # enough programs to fill the GPU, never more than max_splits
            want = -(-int(cfg["min_programs"]) // max(1, T * KV))
            n_split = max(1, min(int(cfg["max_splits"]), want))
        reverse = False
    else:
        if cu_seqlens is None:
            raise ValueError("the prefill kernel needs cu_seqlens to build its query tiles")
        gpad = _next_pow2(group)
        bq = max(1, int(cfg["bm"]) // gpad)
        tseq, tstart, tlen = query_tiles(cu_seqlens, T, bq)
        n_split = 1
        reverse = True
    n_split = int(n_split)
    C = int(tseq.shape[0])
    rows = T * H
    kernel = functools.partial(
        _attn_kernel, bq=bq, gpad=gpad, group=group, heads=H, kv_heads=KV, layers=L,
        block_size=bs, bt_cols=M, bk=bk, scale=float(scale), n_split=n_split,
        n_tiles=C, reverse=reverse)
    if n_split == 1:
        out_shape = jax.ShapeDtypeStruct((rows, hd), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((n_split * rows, hd), jnp.float32),
                     jax.ShapeDtypeStruct((n_split * rows,), jnp.float32),
                     jax.ShapeDtypeStruct((n_split * rows,), jnp.float32))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(C, KV, n_split),
        compiler_params=_compiler_params(int(cfg["warps"]), int(cfg["stages"])),
        interpret=interpret, name="paged_attention_decode" if is_decode else "paged_attention",
    )(tseq, tstart, tlen, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
      block_tables.astype(jnp.int32).reshape(N * M), positions.astype(jnp.int32),
      q.reshape(rows, hd), kv.reshape(nb * L * 2 * bs * KV, hd))
    if n_split == 1:
        return out.reshape(T, H, hd)
    acc, m, l = out
    o = _combine(acc.reshape(n_split, rows, hd), m.reshape(n_split, rows),
                 l.reshape(n_split, rows), q.dtype)
    return o.reshape(T, H, hd)

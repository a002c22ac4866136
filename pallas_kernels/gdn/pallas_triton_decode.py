"""Pallas (Triton-flavoured) decode kernel for the gated delta rule: one token per
sequence against the state pool, in place; or a verify step's few tokens a sequence, in
turn, the state read once and stored after each.

Grid (value head, row block, V tile), state tile [dk, BV] read from the pool slot,
updated, written back to the pool (input_output_aliases), to the same slot or to the
row ``out_slots`` names; a program walks its block's rows
in a loop that Triton pipelines (one row a program where the table says so); for 16-bit
pools the two sums over dk are one tensor-core product (``_dk_sums_mma``), and on the
GPU a bf16 tile is updated in inline PTX on packed pairs (``_update_packed``; interpret
mode, which cannot run PTX, takes the same formula in jnp, unfused, and the GPU check in
bench/kernels.py covers the PTX). It runs on the CPU in interpret mode, as the prefill
bodies in ``pallas_triton.py`` do.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .pallas_triton import _compiler_params, plt
from .reference import _default_scale


def _decode_kernel(slots_ref, out_slots_ref, lens_ref, q_ref, k_ref, v_ref, g_ref, b_ref,
                   pool_in_ref, o_ref, pool_ref, *, ratio, use_l2, scale, bv, n_slots,
                   n_rows, rows, positions, mma, packed):
    """Rows [r0, r0 + rows) of one value head and V tile, each over its ``positions``
    tokens (one; or a verify step's, the tile kept on chip between them and stored after
    each). With more than one row a program the rows are a loop, which Triton
    software-pipelines: the next row's tile is copied into shared memory (cp.async) while
    this one's is updated (bench/RESULTS.md, "GDN kernels": decode)."""
    del pool_in_ref  # aliased with pool_ref
    # heads vary fastest: programs launched together read one slot's contiguous heads
    h = pl.program_id(0)
    r0 = pl.program_id(1) * rows
    iv = pl.program_id(2)
    hk = h // ratio
    v0 = iv * bv

    def row(i, carry):
        inside = r0 + i < n_rows  # the last program's rows may run past the batch
        n = jnp.where(inside, r0 + i, 0)
        slot = slots_ref[n]
        valid = inside & (slot >= 0) & (slot < n_slots)
        length = lens_ref[n]
        # Loads first, the tile's above all: the normalisation synchronises the warps,
        # and loads written after it are issued only once it is done. The load has its
        # own index, the slot clamped into the pool (a padding row's tile is read and
        # dropped), so the loop does not carry its pointers to the store: 154 registers
        # a thread, 3 CTAs an SM, where sharing the store's index allows 2.
        S = pool_ref[jnp.clip(slot, 0, n_slots - 1), h, :, pl.ds(v0, bv)]  # [dk, bv]
        for p in range(positions):
            live = valid & (p < length)
            q = q_ref[n, p, hk, :].astype(jnp.float32)
            k = k_ref[n, p, hk, :].astype(jnp.float32)
            v = v_ref[n, p, h, pl.ds(v0, bv)].astype(jnp.float32)
            decay = jnp.exp(g_ref[n, p, h].astype(jnp.float32))
            bt = b_ref[n, p, h].astype(jnp.float32)
            if use_l2:
                q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6)
                k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
            q = q * scale
            # Both sums over dk read the state before the update, so neither waits for
            # the other (o = S'^T q = decay S^T q + vn (k . q) with S' = decay S + k vn^T),
            # and the decay scales the sums rather than the tile.
            kv, sq = _dk_sums_mma(S, k, q) if mma else _dk_sums(S.astype(jnp.float32), k, q)
            vn = bt * (v - decay * kv)
            o = decay * sq + vn * jnp.sum(k * q)

            @pl.when(inside)
            def _():
                o_ref[n, p, h, pl.ds(v0, bv)] = jnp.where(live, o, 0.0).astype(o_ref.dtype)

            S = _update_packed(S, decay, k, vn) if packed else (
                S.astype(jnp.float32) * decay + k[:, None] * vn[None, :]).astype(S.dtype)
            out = out_slots_ref[n, p]
            written = live & (out >= 0) & (out < n_slots)

            @pl.when(written)
            def _():
                pool_ref[jnp.where(written, out, 0), h, :, pl.ds(v0, bv)] = S
        return carry

    if rows == 1:
        row(0, 0)
    else:
        lax.fori_loop(0, rows, row, 0)


def _update_packed(S, decay, k, vn):
    """decay * S + k vn^T for a bf16 tile on the GPU, in PTX on packed pairs of elements.

    The Triton pipeline under XLA neither contracts a multiply and an add into an FMA
    (Nsight Compute counted the bf16 decode's FP32 work almost all unfused,
    bench/RESULTS.md decode run 5) nor widens a pair of bf16 with fewer than three
    instructions. Here a pair is widened by a shift and a mask, each element takes one
    multiply (k vn) and one FMA in float32, and the pair is rounded back to bf16 once.
    Needs sm80 or newer (``cvt.rn.bf16x2.f32``) and an even number of tile elements a
    thread (dk * bv a multiple of 64 * warps: every tuning entry).
    """
    shape = S.shape
    [out] = plt.elementwise_inline_asm(
        """{
        .reg .b32 lo, hi, a, b;
        shl.b32 lo, $1, 16;
        and.b32 hi, $1, 0xffff0000;
        mul.rn.f32 a, $4, $6;
        mul.rn.f32 b, $5, $7;
        fma.rn.f32 a, lo, $2, a;
        fma.rn.f32 b, hi, $3, b;
        cvt.rn.bf16x2.f32 $0, b, a;
        }""",
        args=[S, jnp.broadcast_to(decay, shape), jnp.broadcast_to(k[:, None], shape),
              jnp.broadcast_to(vn[None, :], shape)],
        constraints="=r,r,f,f,f,f,f,f", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, S.dtype)])
    return out


def _dk_sums(S, k, q):
    """k^T S and q^T S as reductions over the tile's rows."""
    return jnp.sum(S * k[:, None], axis=0), jnp.sum(S * q[:, None], axis=0)


def _dk_sums_mma(S, k, q):
    """k^T S and q^T S for a 16-bit tile as one tensor-core product, S^T [bv, dk] x [dk, 16].

    The cross-warp reductions of ``_dk_sums`` made the bf16-pool kernel wait on its own
    instructions (bench/RESULTS.md, decode run 5). The tile enters the product as loaded;
    k and q enter as two 16-bit columns each, value and remainder (hi + lo carry them to
    ~2^-16 relative), in columns 0-3 of an otherwise zero operand. With the tile as the
    left operand (M = bv) the product is one warpgroup MMA on sm90, and the sums over the
    four columns stay within a thread and its three neighbours (decode run 6).
    """
    cols = lax.broadcasted_iota(jnp.int32, (16, k.shape[0]), 0)  # A's rows: A^T's columns
    parts = []
    for x in (k, q):
        hi = x.astype(S.dtype)
        parts += [hi, (x - hi.astype(jnp.float32)).astype(S.dtype)]
    A = jnp.zeros((16, k.shape[0]), S.dtype)
    for i, part in enumerate(parts):
        A = jnp.where(cols == i, part[None, :], A)
    R = lax.dot_general(S, A, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    c = lax.broadcasted_iota(jnp.int32, R.shape, 1)
    return jnp.sum(jnp.where(c < 2, R, 0.0), axis=1), jnp.sum(jnp.where((c >= 2) & (c < 4), R, 0.0), axis=1)


def gdn_decode_pallas(q, k, v, g, beta, state_pool, slots, out_slots, lengths=None, *,
                      scale=None, use_qk_l2norm=False, interpret=False, config=None):
    from ..tuning import gdn_decode_config, gpu_sm_count
    one = q.ndim == 3  # one token a sequence; else [N, R, ...], up to R each
    if one:
        q, k, v, g, beta, out_slots = (x[:, None] for x in (q, k, v, g, beta, out_slots))
    N, R, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    lengths = jnp.ones((N,), jnp.int32) if lengths is None else lengths
    P = state_pool.shape[0]
    scale = _default_scale(scale, dk)
    cfg = dict(gdn_decode_config(dv, state_pool.dtype))
    if config:
        cfg.update(config)
    bv = min(cfg["bv"], dv)
    if dv % bv:
        bv = dv
    # programs_per_sm: a grid of about that many programs an SM, each looping over its
    # share of the rows; None (or a GPU that does not say its SM count): one row a
    # program. Interpret mode counts one SM.
    n_sm = 1 if interpret else gpu_sm_count()
    rows = 1
    if cfg["programs_per_sm"] and n_sm:
        programs = cfg["programs_per_sm"] * n_sm
        rows = max(1, pl.cdiv(N, max(1, programs // (Hv * (dv // bv)))))
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, ratio=Hv // Hk, use_l2=use_qk_l2norm,
                          scale=float(scale), bv=bv, n_slots=P, n_rows=N, rows=rows,
                          positions=R, mma=cfg["mma"] and state_pool.dtype.itemsize == 2,
                          packed=state_pool.dtype == jnp.bfloat16 and not interpret),
        out_shape=(jax.ShapeDtypeStruct((N, R, Hv, dv), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)),
        grid=(Hv, pl.cdiv(N, rows), dv // bv),
        input_output_aliases={8: 1},
        compiler_params=_compiler_params(cfg["warps"], cfg["stages"]),
        interpret=interpret,
        name="gdn_decode",
    )(slots.astype(jnp.int32), out_slots.astype(jnp.int32), lengths.astype(jnp.int32),
      q, k, v, g, beta, state_pool)
    return (o[:, 0] if one else o), pool

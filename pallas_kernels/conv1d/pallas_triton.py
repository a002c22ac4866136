"""Pallas (Triton-flavoured) kernel bodies for the causal depthwise conv1d.

Prefill: grid (token block, channel block) over the packed tokens; per-token
position-in-sequence (computed in XLA, [T] int32) masks the taps that would
reach into the previous sequence.  The first K-1 tokens of each sequence also
need the cached conv state: those N*(K-1) rows are recomputed in XLA and
written over the kernel's rows (a small scatter), and the new conv state (the
last K-1 inputs of each sequence) is a small XLA gather.

Update: grid (row, channel block); the pool [P, K-1, C] is updated in place
(input_output_aliases); out-of-range slots are padding rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .reference import _act, conv1d_final_state, token_positions


def _pow2_block(C, cap):
    b = 1
    while b * 2 <= cap and C % (b * 2) == 0:
        b *= 2
    return b


def _cparams(warps, stages):
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def _silu(y):
    return y * (1.0 / (1.0 + jnp.exp(-y)))


def _prefill_kernel(pos_ref, x_ref, w_ref, y_ref, *, K, bt, bc, T, C, activation,
                    front):
    it = pl.program_id(0)
    ic = pl.program_id(1)
    t0 = it * bt
    c0 = ic * bc
    rows = t0 + lax.broadcasted_iota(jnp.int32, (bt,), 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0)
    pos = plt.load(pos_ref.at[pl.ds(t0, bt)], mask=rows < T, other=-1)
    colm = cols < C
    acc = jnp.zeros((bt, bc), jnp.float32)
    for j in range(K):
        m = (pos >= (K - 1 - j))[:, None] & colm[None, :]
        xv = plt.load(x_ref.at[pl.ds(front + t0 - (K - 1) + j, bt), pl.ds(c0, bc)],
                      mask=m, other=0.0).astype(jnp.float32)
        wj = plt.load(w_ref.at[pl.ds(c0, bc), jnp.int32(j)], mask=colm, other=0.0).astype(jnp.float32)
        acc = acc + xv * wj[None, :]
    if activation is not None:
        acc = _silu(acc)
    acc = jnp.where((pos >= 0)[:, None], acc, 0.0)
    plt.store(y_ref.at[pl.ds(t0, bt), pl.ds(c0, bc)], acc.astype(y_ref.dtype),
              mask=(rows < T)[:, None] & colm[None, :])


def causal_conv1d_prefill_pallas(x, weight, *, cu_seqlens, initial_state=None,
                                 activation="silu", interpret=False, config=None):
    from ..tuning import conv1d_config
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    act = None if activation is None else "silu"
    T, C = x.shape
    K = weight.shape[1]
    cfg = dict(conv1d_config())
    if config:
        cfg.update(config)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    pos, seq = token_positions(cu, T)
    bt = cfg["bt"]
    if interpret:
        # dynamic slices clamp in interpret mode: pad front by K-1, back by a block
        bc = _pow2_block(C, cfg["bc"])
        front = K - 1
        xk = jnp.concatenate([jnp.zeros((front, C), x.dtype), x,
                              jnp.zeros((bt, C), x.dtype)], 0)
        posk = jnp.concatenate([pos, jnp.full((bt,), -1, jnp.int32)])
        rows = T + bt
    else:
        bc = cfg["bc"]
        front = 0
        xk, posk, rows = x, pos, T
    y = pl.pallas_call(
        functools.partial(_prefill_kernel, K=K, bt=bt, bc=bc, T=T, C=C,
                          activation=act, front=front),
        out_shape=jax.ShapeDtypeStruct((rows, C), x.dtype),
        grid=(pl.cdiv(T, bt), pl.cdiv(C, bc)),
        compiler_params=_cparams(cfg["warps"], cfg["stages"]),
        interpret=interpret,
        name="causal_conv1d_prefill",
    )(posk, xk, weight)[:T]

    # first K-1 rows of every sequence: add the cached-state taps (XLA, small)
    if K > 1:
        lens = cu[1:] - cu[:-1]
        i = jnp.arange(K - 1, dtype=jnp.int32)
        wf = weight.astype(jnp.float32)
        init = (jnp.zeros((N, K - 1, C), jnp.float32) if initial_state is None
                else initial_state.astype(jnp.float32))
        acc = jnp.zeros((N, K - 1, C), jnp.float32)
        for j in range(K):
            rel = i - (K - 1) + j  # source relative to the sequence start
            xv = x[jnp.clip(cu[:-1][:, None] + rel[None, :], 0, max(T - 1, 0))].astype(jnp.float32)
            iv = init[:, jnp.clip(K - 1 + rel, 0, K - 2), :]
            val = jnp.where((rel >= 0)[None, :, None], xv, iv)
            acc = acc + val * wf[:, j][None, None, :]
        fix = _act(acc, act).astype(x.dtype)
        tgt = cu[:-1][:, None] + i[None, :]
        ok = (i[None, :] < lens[:, None]) & (tgt < T)
        tgt = jnp.where(ok, tgt, T)
        y = y.at[tgt.reshape(-1)].set(fix.reshape(-1, C), mode="drop")
    fin = conv1d_final_state(x, cu, initial_state, K)
    return y, fin


def _update_kernel(slots_ref, out_slots_ref, x_ref, w_ref, pool_in_ref, y_ref, pool_ref, *,
                   K, bc, C, P, activation):
    del pool_in_ref
    n = pl.program_id(0)
    ic = pl.program_id(1)
    c0 = ic * bc
    cols = c0 + lax.broadcasted_iota(jnp.int32, (bc,), 0)
    colm = cols < C
    slot = slots_ref[n]
    valid = (slot >= 0) & (slot < P)
    sc = jnp.where(valid, slot, 0)
    xv = plt.load(x_ref.at[n, pl.ds(c0, bc)], mask=colm, other=0.0)
    win = []
    for j in range(K - 1):
        win.append(plt.load(pool_ref.at[sc, jnp.int32(j), pl.ds(c0, bc)], mask=colm, other=0.0))
    win.append(xv.astype(pool_ref.dtype))
    acc = jnp.zeros((bc,), jnp.float32)
    for j in range(K):
        wj = plt.load(w_ref.at[pl.ds(c0, bc), jnp.int32(j)], mask=colm, other=0.0).astype(jnp.float32)
        acc = acc + win[j].astype(jnp.float32) * wj
    if activation is not None:
        acc = _silu(acc)
    acc = jnp.where(valid, acc, 0.0)
    plt.store(y_ref.at[n, pl.ds(c0, bc)], acc.astype(y_ref.dtype), mask=colm)

    out = out_slots_ref[n]
    written = valid & (out >= 0) & (out < P)
    oc = jnp.where(written, out, 0)

    @pl.when(written)
    def _():
        for j in range(K - 1):
            plt.store(pool_ref.at[oc, jnp.int32(j), pl.ds(c0, bc)], win[j + 1], mask=colm)


def causal_conv1d_update_pallas(x, weight, state_pool, slots, out_slots, *,
                                activation="silu", interpret=False, config=None):
    from ..tuning import conv1d_config
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    act = None if activation is None else "silu"
    N, C = x.shape
    K = weight.shape[1]
    P = state_pool.shape[0]
    cfg = dict(conv1d_config())
    if config:
        cfg.update(config)
    bc = _pow2_block(C, cfg["update_bc"]) if interpret else cfg["update_bc"]
    y, pool = pl.pallas_call(
        functools.partial(_update_kernel, K=K, bc=bc, C=C, P=P, activation=act),
        out_shape=(jax.ShapeDtypeStruct((N, C), x.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)),
        grid=(N, pl.cdiv(C, bc)),
        input_output_aliases={4: 1},
        compiler_params=_cparams(cfg["warps"], cfg["stages"]),
        interpret=interpret,
        name="causal_conv1d_update",
    )(slots.astype(jnp.int32), out_slots.astype(jnp.int32), x, weight, state_pool)
    return y, pool

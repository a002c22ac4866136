"""Pallas (Triton-flavoured) ``x @ w[layer]`` for decode-size row counts.

Why: the scanned model's dense weights are stacked over layers, and inside the layer scan
XLA materialises each layer's slice before its GEMM (a copy of every dense weight on every
step: 3.6 ms of a 24.8 ms 35B-A3B decode step on an H200, bench/RESULTS.md). At decode
sizes the GEMM is a weight stream, so reading the layer in place is the whole gain.

Grid (column tile, K split). A program holds all M rows (M a power of two from 16: the
wrapper pads) and streams its [K / splits, bn] slab of ``w[layer]`` once, bk rows at a
time; splits > 1 give enough programs for narrow outputs (N / bn < the SM count), their
float32 partial sums are added by XLA afterwards.

FP8 weights (block_fp8: e4m3 with 128 x 128 block scales) stream as they are, half the
bytes; a tile lies in one scale block, so it is widened to x's dtype in registers (e4m3
is exact in bf16) and its float32 partial product is scaled by its block's scale.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..block_fp8 import BLOCK, is_fp8, tile_fits


def _kernel(layer_ref, x_ref, w_ref, *refs, bn, bk, k_split):
    s_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    n0 = pl.program_id(0) * bn
    k_base = pl.program_id(1) * k_split
    layer = layer_ref[0]

    def step(j, acc):
        k0 = pl.multiple_of(k_base + j * bk, bk)
        xt = x_ref[:, pl.ds(k0, bk)]
        wt = w_ref[layer, pl.ds(k0, bk), pl.ds(n0, bn)]
        if s_ref is None:
            return acc + jnp.dot(xt, wt, preferred_element_type=jnp.float32)
        part = jnp.dot(xt, wt.astype(xt.dtype), preferred_element_type=jnp.float32)
        return acc + part * s_ref[layer, k0 // BLOCK, n0 // BLOCK]

    acc = lax.fori_loop(0, k_split // bk, step,
                        jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    o_ref[pl.program_id(1), :, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


def tiles_fit(x, w, cfg, scale=None) -> bool:
    """The kernel takes K and N in whole bk / bn tiles and one dtype for x and w, or an
    FP8 w with its block scales whose tiles each lie in one scale block."""
    _, k, n = w.shape
    if scale is not None:
        return is_fp8(w) and tile_fits(cfg["bk"], cfg["bn"], k, n, n)
    return x.dtype == w.dtype and k % cfg["bk"] == 0 and n % cfg["bn"] == 0


def splits_for(n: int, k: int, cfg: dict) -> int:
    """K splits: the fewest (a power of two dividing K / bk) that give at least
    cfg["min_programs"] programs."""
    splits = 1
    while (n // cfg["bn"]) * splits < cfg["min_programs"] and k % (2 * splits * cfg["bk"]) == 0:
        splits *= 2
    return splits


def layer_matmul_pallas(x, w, layer, scale=None, *, interpret=False, config=None):
    """x [M, K], w [L, K, N] -> x @ w[layer] in x's dtype, float32 accumulation; an FP8
    ``w`` comes with its block scales [L, K/128, N/128]."""
    from ..tuning import layer_matmul_config

    cfg = config or layer_matmul_config()
    if not tiles_fit(x, w, cfg, scale):
        raise ValueError(f"layer matmul tiles {cfg['bk']} x {cfg['bn']} do not fit "
                         f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    m, k = x.shape
    n = w.shape[2]
    rows = max(16, 1 << (m - 1).bit_length())  # a Triton block is a power of two
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x
    splits = splits_for(n, k, cfg)
    out = pl.pallas_call(
        functools.partial(_kernel, bn=cfg["bn"], bk=cfg["bk"], k_split=k // splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n),
                                       x.dtype if splits == 1 else jnp.float32),
        grid=(n // cfg["bn"], splits),
        compiler_params=plt.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"]),
        interpret=interpret,
        name="layer_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), xp, w,
      *(() if scale is None else (scale,)))
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return out[:m] if rows != m else out

"""Pallas (Triton-flavoured) ``x @ w[layer]`` for decode-size row counts, for one weight
or several read by the same rows in one launch.

Why: the scanned model's dense weights are stacked over layers, and inside the layer scan
XLA materialises each layer's slice before its GEMM (a copy of every dense weight on every
step: 3.6 ms of a 24.8 ms 35B-A3B decode step on an H200, bench/RESULTS.md). At decode
sizes the GEMM is a weight stream, so reading the layer in place is the whole gain. The
projections of one x (GDN in_proj qkv / z / b / a, attention q / k / v, the router and
the shared expert's gate / up) are each a few microseconds of bytes, so a launch apiece
costs about as much as their bytes: they share one launch here.

Grid (column tile, K split) over the weights' column tiles laid side by side, each
writing its columns of one concatenated output; each weight's tiles are a static range
of the tile index, and a program runs the branch of the weight its tile is in. A weight
narrower than bn takes a tile of its own width (``tile_width``). A program holds all M
rows (M a power of two from 16: the wrapper pads) and streams its [K / splits, width]
slab of ``w[layer]`` once, bk rows at a time; splits > 1 give enough programs for
narrow outputs (column tiles < the SM count), their float32 partial sums are added by
XLA afterwards.

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


def _kernel(layer_ref, x_ref, *refs, bk, k_split, parts, scaled):
    """``refs``: the weights, the scales of those ``scaled`` marks, then the output.
    ``parts[j]``: weight j's (first column tile, tile width, first output column)."""
    ws = refs[:len(scaled)]
    scales = iter(refs[len(scaled):-1])
    s_refs = [next(scales) if s else None for s in scaled]
    o_ref = refs[-1]
    tile, split = pl.program_id(0), pl.program_id(1)
    k_base = split * k_split
    layer = layer_ref[0]

    def run(w_ref, s_ref, first, bn, col):
        n0 = (tile - first) * bn

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
        o_ref[split, :, pl.ds(col + n0, bn)] = acc.astype(o_ref.dtype)

    if len(ws) == 1:  # one weight: every program's, no branch
        run(ws[0], s_refs[0], *parts[0])
        return
    ends = [first for first, _, _ in parts[1:]] + [None]
    for w_ref, s_ref, part, end in zip(ws, s_refs, parts, ends):
        inside = tile >= part[0] if end is None else (tile >= part[0]) & (tile < end)
        pl.when(inside)(functools.partial(run, w_ref, s_ref, *part))


def tile_width(n: int, bn: int) -> int | None:
    """The column tile of an output N wide: bn where N is whole bn tiles, else N itself
    where it is a power of two from 16 below bn (a Triton block is a power of two; the
    GDN's 32-wide b / a projections), else None (no tile fits)."""
    if n % bn == 0:
        return bn
    return n if 16 <= n < bn and n & (n - 1) == 0 else None


def tiles_fit(x, w, cfg, scale=None) -> bool:
    """The kernel takes K in whole bk tiles, N in whole tiles (``tile_width``) and one
    dtype for x and w, or an FP8 w with its block scales whose tiles each lie in one
    scale block."""
    _, k, n = w.shape
    bn = tile_width(n, cfg["bn"])
    if bn is None:
        return False
    if scale is not None:
        return is_fp8(w) and tile_fits(cfg["bk"], bn, k, n, n)
    return x.dtype == w.dtype and k % cfg["bk"] == 0


def splits_for(tiles: int, k: int, cfg: dict) -> int:
    """K splits: the fewest (a power of two dividing K / bk) that give at least
    cfg["min_programs"] programs over ``tiles`` column tiles."""
    splits = 1
    while tiles * splits < cfg["min_programs"] and k % (2 * splits * cfg["bk"]) == 0:
        splits *= 2
    return splits


def layer_matmul_pallas(x, ws, layer, scales=None, *, interpret=False, config=None):
    """x [M, K], ws: weights [L, K, N_j] -> (x @ w[layer] for each w) in x's dtype,
    float32 accumulation, in one launch; ``scales``: per weight, an FP8 weight's block
    scales [L, K/128, N_j/128] or None."""
    from ..tuning import layer_matmul_config

    cfg = config or layer_matmul_config()
    scales = (None,) * len(ws) if scales is None else tuple(scales)
    for w, scale in zip(ws, scales, strict=True):
        if w.shape[:2] != ws[0].shape[:2] or not tiles_fit(x, w, cfg, scale):
            raise ValueError(f"layer matmul tiles {cfg['bk']} x {cfg['bn']} do not fit "
                             f"x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    m, k = x.shape
    widths = [w.shape[2] for w in ws]
    bns = [tile_width(n, cfg["bn"]) for n in widths]
    tiles = [n // bn for n, bn in zip(widths, bns)]
    parts = tuple((sum(tiles[:j]), bns[j], sum(widths[:j])) for j in range(len(ws)))
    n = sum(widths)
    rows = max(16, 1 << (m - 1).bit_length())  # a Triton block is a power of two
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x
    splits = splits_for(sum(tiles), k, cfg)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=cfg["bk"], k_split=k // splits, parts=parts,
                          scaled=tuple(s is not None for s in scales)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n),
                                       x.dtype if splits == 1 else jnp.float32),
        grid=(sum(tiles), splits),
        compiler_params=plt.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"]),
        interpret=interpret,
        name="layer_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), xp, *ws,
      *(s for s in scales if s is not None))
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    out = out[:m] if rows != m else out
    bounds = [sum(widths[:j + 1]) for j in range(len(ws) - 1)]
    return tuple(jnp.split(out, bounds, axis=1)) if bounds else (out,)

"""Pallas (Triton-flavoured) grouped matmul for decode-size MoE batches.

Grid (expert, column tile). A program finds its expert's rows from the group
starts and walks them bm at a time, streaming the expert's [K, bn] weight column
through bk-deep steps; an expert with no rows returns at once, so a step reads only
the weights of the experts its tokens were routed to (under uniform routing, 1 - (1 - 8/256)^N
of 256 experts at N decode sequences x top-8: about 87 % at 64, about 40 % at 16).

The weights may be a stack of several layers' experts ([L * E, K, N]); the program
reads ``w[group_offset + e]`` in place. That is the point of taking an offset: a
scanned model passes its stacked expert weights whole, where slicing one layer out
first would copy every expert of every layer on every step.

W8A8 experts (block_fp8): the rows arrive as e4m3 with a scale per 128-entry group,
the experts K-major; a step multiplies the two e4m3 tiles (1.2-1.3x faster than
widening both to bf16 first, same tiles, on the H100: bench/RESULTS.md, W8A8 experts)
and scales the float32 product by the rows' and the block's scales.

Rows past the last group are not written (the caller masks them, as for the Mosaic
kernel). Out-of-bounds dynamic slices clamp in interpret mode, so the wrapper pads the
rows by one tile there. On the GPU masked loads and stores never touch memory past the
end (as in the GDN kernels), so it pads only arrays shorter than one row tile: padding
every call costs a pad of x and a slice of the output, about 160 small copy kernels in
a 35B-A3B decode step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..block_fp8 import BLOCK, column_block, is_fp8, tile_fits


def _kernel(off_ref, starts_ref, x_ref, w_ref, *refs, bm, bn, bk, k, part):
    s_ref, xs_ref, o_ref = refs if len(refs) == 3 else (None, None, refs[0])
    e = pl.program_id(0)
    n0 = pl.program_id(1) * bn
    g = off_ref[0] + e
    start = starts_ref[e]
    end = starts_ref[e + 1]
    row = lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    scale_row = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    out_row = lax.broadcasted_iota(jnp.int32, (bm, bn), 0)

    def row_tile(i, carry):
        r0 = start + i * bm
        live = row < end - r0

        def k_step(j, acc):
            k0 = pl.multiple_of(j * bk, bk)
            xt = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=live, other=0.0)
            if s_ref is None:
                wt = w_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)]
                return acc + jnp.dot(xt, wt, preferred_element_type=jnp.float32)
            wt = w_ref[g, pl.ds(n0, bn), pl.ds(k0, bk)]  # W8A8: e4m3, K-major [bn, bk]
            prod = lax.dot_general(xt, wt, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
            xs = plt.load(xs_ref.at[pl.ds(r0, bm), pl.ds(k0 // BLOCK, 1)],
                          mask=scale_row < end - r0, other=0.0)
            return acc + prod * (xs * s_ref[g, column_block(n0, part), k0 // BLOCK])

        acc = lax.fori_loop(0, k // bk, k_step, jnp.zeros((bm, bn), jnp.float32))
        plt.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                  mask=out_row < end - r0)
        return carry

    lax.fori_loop(0, (end - start + bm - 1) // bm, row_tile, 0)


def tiles_fit(x, w, cfg, scale=None, splits: int = 1) -> bool:
    """The kernel takes K and N in whole bk / bn tiles and one dtype for x and w, or FP8
    x and K-major w with block scales whose tiles each lie in one scale block."""
    if scale is not None:
        _, n, k = w.shape
        return (is_fp8(w) and is_fp8(x)
                and tile_fits(cfg["bk"], cfg["bn"], k, n, n // splits))
    _, k, n = w.shape
    return x.dtype == w.dtype and k % cfg["bk"] == 0 and n % cfg["bn"] == 0


def grouped_matmul_pallas(x, w, group_sizes, group_offset=0, scale=None, splits: int = 1, *,
                          x_scale=None, out_dtype=None, interpret=False, config=None):
    """x [R, K] sorted by group, w [G, K, N], group_sizes [E] (E <= G): out[r] = x[r] @
    w[group_offset + e] for the rows r of group e; float32 accumulation, x's dtype out.
    W8A8 (``scale`` given, block_fp8): x is e4m3 with its group scales ``x_scale``
    [R, K/128], w K-major [G, N, K] with block scales [G, N/128, K/128] (``splits``
    parts on N, each with its own blocks); ``out_dtype`` out."""
    from ..tuning import grouped_matmul_config

    r = x.shape[0]
    cfg = config or grouped_matmul_config(r, fp8=scale is not None)
    bm, bn, bk = cfg["bm"], cfg["bn"], cfg["bk"]
    if not tiles_fit(x, w, cfg, scale, splits):
        raise ValueError(f"grouped matmul tiles {bk} x {bn} do not fit x {x.shape} {x.dtype}, "
                         f"w {w.shape} {w.dtype}" + (" with block scales" if scale is not None else ""))
    k, n = (w.shape[2], w.shape[1]) if scale is not None else w.shape[1:]
    e = group_sizes.shape[0]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              jnp.cumsum(group_sizes.astype(jnp.int32))])
    offset = jnp.reshape(jnp.asarray(group_offset, jnp.int32), (1,))
    pad = bm if interpret else max(0, bm - r)  # a row tile never spans more than the array
    pad_rows = lambda a: jnp.pad(a, ((0, pad), (0, 0))) if pad else a  # noqa: E731
    fp8 = () if scale is None else (scale, pad_rows(x_scale))
    out = pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, bk=bk, k=k, part=n // splits),
        out_shape=jax.ShapeDtypeStruct((r + pad, n), out_dtype or x.dtype),
        grid=(e, n // bn),
        compiler_params=plt.CompilerParams(num_warps=cfg["warps"], num_stages=cfg["stages"]),
        interpret=interpret,
        name="grouped_matmul",
    )(offset, starts, pad_rows(x), w, *fp8)
    return out[:r] if pad else out

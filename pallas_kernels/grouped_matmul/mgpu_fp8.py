"""Mosaic GPU grouped matmul on e4m3 operands (sm90: FP8 wgmma + TMA), for prefill-size
MoE batches on FP8 experts.

The tile walk is ``mgpu.py``'s (the same tile table, walked round-robin by the CTAs, the
row ladder of TMA stores); what differs is the product. Both operands are e4m3: the rows
quantised in 128-entry groups (``block_fp8.quantize_rows``), the experts as they are.
wgmma reads 8-bit operands only K-major, so the experts come [G, N, K] (``block_fp8``:
the K-major expert layout), and a [block_n, block_k] tile is handed to wgmma transposed.

The scales change every 128 entries of K, so one 128-deep step's product cannot share
an accumulator with the next: each step runs wgmma into a fresh accumulator, waits, and
adds the product times the step's scales (a row's group scale times the weight block's)
to a float32 sum kept in registers (DeepGEMM's promotion; it also keeps the tensor
cores' reduced-precision FP8 accumulation to 128 products). The row scales arrive
through the same pipeline as the operands, transposed ([K/128, R]) so that a step's
are one contiguous TMA box.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._mgpu import load, wgmma_transforms
from ..block_fp8 import BLOCK, column_block
from .mgpu import persistent_kernel, store_tile, tile_table

# One tile: 64 rows (a warpgroup's wgmma), one 128 x 128 scale block of the weight per
# step, so a step scales its product by one weight scale and one scale a row. The
# accumulator and the running sum hold 64 + 64 float32 registers a thread. Two CTAs an
# SM (3 stages each, 2 x 88 KB of SMEM): while one scales its product the other's wgmma
# runs, which took 12-36 % off one CTA at 4 stages (H100, 16384-65536 rows;
# bench/RESULTS.md, "Two CTAs an SM for the W8A8 kernel").
FP8_TILES = dict(block_m=64, block_n=BLOCK, block_k=BLOCK, max_concurrent_steps=3,
                 ctas_per_sm=2)


def fp8_tiles_fit(k: int, n: int, part: int) -> bool:
    """K and N are whole 128 tiles and every column tile lies in one part."""
    return k % BLOCK == 0 and n % BLOCK == 0 and part % BLOCK == 0


def grouped_matmul_fp8_mgpu(xq, xs, wq, group_sizes, group_offset=0, *, ws, part: int,
                            out_dtype, block_m: int, block_n: int, block_k: int,
                            max_concurrent_steps: int, ctas_per_sm: int = 1):
    """xq [R, K] e4m3 (R a multiple of block_m, rows sorted by group) with group scales
    xs [R, K/128]; wq [G, N, K] e4m3 with block scales ws [G, N/128, K/128] (``part``:
    the columns of each part of a fused tensor, block_fp8.column_block); group_sizes [E]:
    out[r] = sum over 128-blocks kb of xs[r, kb] ws[g, nb, kb] (xq[r, kb] . wq[g, :,
    kb]) for the rows r of group e, g = group_offset + e; float32 sums, ``out_dtype``
    out. Rows past sum(group_sizes) are not written. ``ctas_per_sm`` CTAs share an SM's
    tiles."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = xq.shape
    _, n, _ = wq.shape
    if block_k != BLOCK or block_n != BLOCK or m % block_m or not fp8_tiles_fit(k, n, part):
        raise ValueError(f"FP8 tiles {block_m} x {block_n} x {block_k} do not fit x "
                         f"{xq.shape}, w {wq.shape} (parts of {part} columns)")
    table = tile_table(group_sizes, group_offset, m, block_m)
    t_max = table.shape[1]
    grid_n = n // block_n
    wg = plgpu.Layout.WGMMA
    row_vec = wg.reduce(1)
    tr = wgmma_transforms(block_k, 1)

    def body(table_gmem, x_gmem, xs_gmem, w_gmem, s_gmem, o_gmem):
        @plgpu.nd_loop((t_max, grid_n), collective_axes="sm")
        def _tile(info):
            t, ni = info.index
            group, block = table_gmem[0, t], table_gmem[1, t]
            lo, size = table_gmem[2, t], table_gmem[3, t]
            nb = column_block(ni * block_n, part)

            @pl.when(size > 0)
            def _():
                def step(idx, x_smem, xs_smem, w_smem, acc):
                    def product(part_ref):
                        plgpu.wgmma(part_ref, x_smem, w_smem.transpose((1, 0)))
                        plgpu.wgmma_wait(0)
                        return part_ref[...]

                    prod = pl.run_scoped(product, plgpu.ACC((block_m, block_n)))
                    scale = load(xs_smem.at[0], row_vec) * s_gmem[group, nb, idx[0]]
                    return acc + prod * lax.broadcast_in_dim(scale, (block_m, block_n), [0])

                acc = plgpu.emit_pipeline(
                    step,
                    grid=(k // block_k,),
                    in_specs=[
                        plgpu.BlockSpec((block_m, block_k), lambda kk: (block, kk),
                                        transforms=tr),
                        plgpu.BlockSpec((1, block_m), lambda kk: (kk, block)),
                        plgpu.BlockSpec((block_n, block_k), lambda kk: (ni, kk),
                                        transforms=tr),
                    ],
                    max_concurrent_steps=max_concurrent_steps,
                    init_carry=plgpu.layout_cast(
                        jnp.zeros((block_m, block_n), jnp.float32), wg),
                )(x_gmem, xs_gmem, w_gmem.at[group])

                store_tile(acc, o_gmem, block, ni, lo, size)

    return persistent_kernel(body, jax.ShapeDtypeStruct((m, n), out_dtype),
                             plgpu.LoweringSemantics.Lane, ctas_per_sm)(table, xq, xs.T, wq, ws)

"""Helpers shared by the Mosaic GPU (``plgpu.kernel``) kernels.

Kept apart so the kernels read as their algorithm: the row-count ladder every
dynamic-length TMA store needs, the SMEM transforms wgmma operands need, a load into a
named register layout that works on jax 0.10 and 0.11 alike, a group of wgmma products
waited for together, zeroing an SMEM tile's rows outside a range, and the GDN launches'
compiler parameters.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def wgmma_transforms(cols: int, itemsize: int):
    """SMEM tiling + swizzle for a wgmma operand whose rows hold ``cols`` elements:
    the widest swizzle (≤ 128 B) the row fits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = min(128, cols * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def load(ref, layout, optimized=True):
    """``ref`` into registers in ``layout`` (0.10 takes the index separately; 0.11
    deprecates it). ``optimized=False`` accepts a bank-conflicted transfer (an
    untiled SMEM buffer read once per CTA)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if jax.__version_info__ < (0, 11):
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def store_rows(src_smem, dst, lo, size, max_rows: int):
    """TMA-store rows [lo, lo + size) of ``src_smem`` (untiled, its rows on axis 0) to
    ``dst(row, n)``, the GMEM ref of n rows that receive source rows [row, row + n).

    A TMA copy has a static shape and the row count is dynamic, so the rows go in
    stores of 2^j rows for each set bit j of ``size``, largest first; rows outside the
    range (another sequence's, another group's) are never written. The caller commits
    SMEM before and waits for the stores after."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    row = lo
    for j in reversed(range(int(math.log2(max_rows)) + 1)):
        n = 1 << j

        @pl.when(size & n != 0)
        def _(row=row, n=n):
            plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(row, n)], dst(row, n))

        row = row + (size & n)


def approx_math_params():
    """Lane semantics and the fast (approximate) exp, for the GDN prefill's two launches
    (gdn/mgpu_chunk.py, gdn/mgpu_intra.py). Every exponent there is a gate difference
    <= 0 whose result multiplies 16-bit operands, so the approximation's ~2 ulp of
    float32 vanish under their rounding (outputs moved by 3e-5 relative, against 1e-2
    for bf16 itself), and the exps are a large share of
    each warpgroup's instructions: at 1x8192 Hk16 Hv64 the sequential launch went
    0.249 -> 0.225 ms and the intra launch 0.153 -> 0.147 (bench/RESULTS.md, prefill
    run 8)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams(approx_math=True,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def mma(*accs, pairs):
    """accs[i] = x_i y_i, one wgmma group; y_i in SMEM, x_i in SMEM or in registers
    (a 16-bit array in the WGMMA layout)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    for acc, (x, y) in zip(accs, pairs):
        plgpu.wgmma(acc, x, y)
    plgpu.wgmma_wait(0)
    return [acc[...] for acc in accs]


def zero_rows_outside(ref, lo, hi):
    """Zero the rows of a 64-row SMEM tile outside [lo, hi), in place."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    wg = plgpu.Layout.WGMMA
    r = plgpu.broadcasted_iota(jnp.int32, ref.shape, 0, layout=wg)
    x = load(ref, wg)
    ref[...] = jnp.where((r >= lo) & (r < hi), x, 0)
    plgpu.commit_smem()

"""Helpers shared by the Mosaic GPU (``plgpu.kernel``) kernels.

Kept apart so the kernels read as their algorithm: the row-count ladder every
dynamic-length TMA store needs, the SMEM transforms wgmma operands need, and a load
into a named register layout that works on jax 0.10 and 0.11 alike.
"""
from __future__ import annotations

import math

import jax


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

"""Mosaic GPU grouped matmul for prefill-size MoE batches (sm90: wgmma + TMA).

The work is a list of tiles, one per (row block, group) pair that holds rows, built in
XLA before the launch (``tile_table``): tile t multiplies rows [lo, lo + size) of row
block ``block`` by ``w[group]``. The CTAs (one an SM; ``persistent_kernel``) walk the
tiles x column tiles round-robin; a tile's K loop is a TMA pipeline feeding wgmma, and its
rows are stored by a ladder of power-of-two TMA stores (``_mgpu.store_rows``: a TMA
store has a static shape, the row count is dynamic).

Two things JAX's ``ragged_dot_mgpu`` does not do, and why they matter here:
  * ``group`` is an index into the whole weight stack ([L * E, K, N], every layer's
    experts), so the scanned model passes the stack as it is. Slicing one layer's
    experts out inside the layer scan materialises a copy of all of them: 38 ms of a
    261 ms 8192-token 35B-A3B prefill (bench/RESULTS.md).
  * the table is read, not derived: JAX's kernel unrolls a select chain over every
    group per tile (256 groups x ~10 scalar ops before each tile's first TMA), and
    it runs the whole K loop for row-block/group pairs without rows; tiles past the
    table's live count do nothing here.

Rows must fill whole row blocks (``padded_call`` pads); rows past sum(group_sizes)
are not written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._mgpu import store_rows

# Tiles in order of preference; the first whose block_k divides K and block_n
# divides N is taken. On the H200 (bench/RESULTS.md, the Mosaic grouped matmul)
# 64 x 256 x 64 with 4 stages is the best of six tiles at 16384 rows; at 65536 rows
# 5 stages gain 4 % on 2048 -> 1024 and 128 x 128 gains 10 % on 512 -> 2048, a
# row-dependent choice worth 2 % of a prefill, so one tile serves every row count.
MGPU_TILES = (
    dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4),
    dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4),
)


def mgpu_tiles(x, w) -> dict | None:
    """The kernel's tile arguments for these operands, or None where it does not
    take them (dtype other than one shared 16-bit type, K or N off every tile)."""
    _, k, n = w.shape
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        return None
    for tiles in MGPU_TILES:
        if k % tiles["block_k"] == 0 and n % tiles["block_n"] == 0:
            return tiles
    return None


def tile_table(group_sizes, group_offset, rows: int, block_m: int):
    """int32 [4, T]: per tile (group + group_offset, row block, first row within the
    block, row count), tiles in row order, then zero-row tiles up to T = the static
    bound cdiv(rows, block_m) + E - 1 (a group adds at most one block it shares)."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    count = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)
    tile_end = jnp.cumsum(count)
    t_max = -(-rows // block_m) + e - 1
    t = jnp.arange(t_max, dtype=jnp.int32)
    # compare_all: one fused kernel (the default searchsorted is a loop of kernels on GPU)
    g = jnp.searchsorted(tile_end, t, side="right", method="compare_all")
    g = jnp.minimum(g, e - 1).astype(jnp.int32)
    block = first[g] + t - (tile_end[g] - count[g])
    lo = jnp.maximum(starts[g], block * block_m)
    hi = jnp.minimum(ends[g], (block + 1) * block_m)
    live = t < tile_end[-1]
    size = jnp.where(live, hi - lo, 0)
    return jnp.stack([g + jnp.asarray(group_offset, jnp.int32), jnp.where(live, block, 0),
                      jnp.where(live, lo - block * block_m, 0), size])


def grouped_matmul_mgpu(x, w, group_sizes, group_offset=0, *, block_m: int, block_n: int,
                        block_k: int, max_concurrent_steps: int):
    """x [R, K] (R a multiple of block_m, rows sorted by group), w [G, K, N], group_sizes
    [E]: out[r] = x[r] @ w[group_offset + e] for the rows r of group e, float32
    accumulation, x's dtype out."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    _, _, n = w.shape
    if m % block_m or k % block_k or n % block_n:
        raise ValueError(f"tiles {block_m} x {block_n} x {block_k} do not divide "
                         f"x {x.shape}, w {w.shape}")
    table = tile_table(group_sizes, group_offset, m, block_m)
    t_max = table.shape[1]
    grid_n = n // block_n

    def body(table_gmem, x_gmem, w_gmem, o_gmem):
        @plgpu.nd_loop((t_max, grid_n), collective_axes="sm")
        def _tile(info):
            t, ni = info.index
            group, block = table_gmem[0, t], table_gmem[1, t]
            lo, size = table_gmem[2, t], table_gmem[3, t]

            @pl.when(size > 0)
            def _():
                def k_loop(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem),
                        grid=(k // block_k,),
                        in_specs=[
                            plgpu.BlockSpec((block_m, block_k), lambda kk: (block, kk),
                                            delay_release=1),
                            plgpu.BlockSpec((block_k, block_n), lambda kk: (kk, ni),
                                            delay_release=1),
                        ],
                        max_concurrent_steps=max_concurrent_steps,
                    )(x_gmem, w_gmem.at[group])
                    return acc_ref[...]

                acc = pl.run_scoped(k_loop, plgpu.ACC((block_m, block_n)))
                store_tile(acc, o_gmem, block, ni, lo, size)

    return persistent_kernel(body, jax.ShapeDtypeStruct((m, n), x.dtype),
                             plgpu.LoweringSemantics.Warpgroup)(table, x, w)


def store_tile(acc, o_gmem, block, ni, lo, size):
    """Rows [lo, lo + size) of the tile ``acc`` (row block ``block``, column tile ``ni``
    of o_gmem) through SMEM and the ladder of TMA row stores."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_m, block_n = acc.shape

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), o_gmem.dtype))
    def _store(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        store_rows(o_smem, lambda row, rows: o_gmem.at[
            pl.ds(block * block_m + row, rows), pl.ds(ni * block_n, block_n)],
            lo, size, block_m)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def persistent_kernel(body, out_type, semantics, ctas_per_sm: int = 1):
    """``body`` as a kernel of ``ctas_per_sm`` CTAs an SM, whose loops over tiles are
    split over the CTAs (``collective_axes="sm"``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sms = getattr(jax.devices()[0], "core_count", 132)  # H100: 132, H200: 132
    return plgpu.kernel(body, out_type=out_type, grid=(ctas_per_sm * sms,), grid_names=("sm",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=semantics))


def padded_call(kernel, x, w, group_sizes, group_offset, tiles: dict):
    """Run ``kernel(*x, w, group_sizes, group_offset, **tiles)`` on rows padded to whole
    row blocks and return the first R rows; ``x`` is the rows [R, ...], or a tuple of
    arrays with R rows each (e4m3 rows and their scales). Separate from the kernel so
    the padding contract is testable on any platform."""
    xs = x if isinstance(x, tuple) else (x,)
    r = xs[0].shape[0]
    bm = tiles["block_m"]
    rows = max(bm, -(-r // bm) * bm)
    if rows != r:
        xs = tuple(jnp.pad(a, ((0, rows - r),) + ((0, 0),) * (a.ndim - 1)) for a in xs)
    out = kernel(*xs, w, group_sizes.astype(jnp.int32), group_offset, **tiles)
    return out[:r] if rows != r else out

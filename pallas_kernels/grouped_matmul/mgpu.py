"""JAX's Mosaic GPU grouped matmul (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``):
wgmma + TMA, the fastest path on sm90 for many rows per expert (prefill). Anchors.md:
``jax.lax.ragged_dot`` runs about 90x slower on Hopper (124.5 ms against 1.38 ms for
8192 tokens x top-8 over 256 experts).

What the kernel needs, and how the wrapper provides it:
  * lhs and rhs of one 16-bit dtype (it accumulates in float32 and writes the
    lhs dtype, as the reference does after its float32 product);
  * K a multiple of block_k and N of block_n (MGPU_TILES; else: another path);
  * at least block_m rows, tiled by block_m: rows are zero-padded up to a
    multiple of block_m. The kernel writes only rows below sum(group_sizes),
    so the padding rows (never part of a group) are left unwritten and cut off.
  * weights laid out [E, K, N] (our MoE's layout, ``x @ w[e]``): no transpose;
    exactly one weight matrix per group, so a layer's experts are sliced out of
    a stack of layers first (a copy of the layer's expert weights).

Every (row tile + group boundary) x column tile runs the whole K loop, empty groups
and unused tiles included, so its time hardly falls with fewer rows: for decode-size
row counts ``pallas_triton.py`` is faster (bench/RESULTS.md).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

# Tiles in order of preference; the first whose block_k divides K and block_n
# divides N is taken. H200, jax 0.11.2, 2026-11-30 (bench/RESULTS.md): 64 x 256
# x 64 with 4 stages was the fastest of four tiles at every row count measured,
# for both 35B-A3B expert shapes (e.g. 2048 -> 1024 over 256 experts: 0.34 ms at
# 512 rows against 0.44 ms for 128 x 128; 0.54 ms against 0.68 ms at 16384 rows).
MGPU_TILES = (
    dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=1),
    dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
)


def mgpu_tiles(x, w) -> dict | None:
    """The kernel's tile arguments for these operands, or None where it does not
    take them (dtype other than one shared 16-bit type, K or N off every tile)."""
    _, k, n = w.shape
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        return None
    for tiles in MGPU_TILES:
        if k % tiles["block_k"] == 0 and n % (tiles["block_n"] * tiles["grid_block_n"]) == 0:
            return tiles
    return None


def padded_call(kernel, x, w, group_sizes, tiles: dict):
    """Run ``kernel(lhs, rhs, group_sizes=..., **tiles)`` on rows padded to whole
    row tiles and return the first R rows. Separate from the kernel import so the
    padding contract is testable on any platform."""
    r = x.shape[0]
    bm = tiles["block_m"]
    rows = max(bm, -(-r // bm) * bm)
    if rows != r:
        x = jnp.pad(x, ((0, rows - r), (0, 0)))
    out = kernel(x, w, group_sizes=group_sizes.astype(jnp.int32), **tiles)
    return out[:r] if rows != r else out


@functools.lru_cache(maxsize=None)
def mgpu_kernel():
    """JAX's Mosaic GPU grouped matmul, imported on first use (GPU only)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot

"""Grouped matmul for MoE experts: rows sorted by expert, one weight matrix each.

``jax.lax.ragged_dot`` is the portable path (CPU, and the oracle); on Hopper it
runs about 90x slower than JAX's Mosaic GPU grouped matmul (anchors.md: 124.5 ms
against 1.38 ms for 8192 tokens x top-8 over 256 experts), so "auto" takes that
kernel (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot``) on sm90
whenever the shapes and dtypes fit it, and the reference otherwise.

What the kernel needs, and how the wrapper provides it:
  * lhs and rhs of one 16-bit dtype (it accumulates in float32 and writes the
    lhs dtype, as the reference does after its float32 product);
  * K a multiple of block_k and N of block_n (MGPU_TILES; else: the reference);
  * at least block_m rows, tiled by block_m: rows are zero-padded up to a
    multiple of block_m. The kernel writes only rows below sum(group_sizes),
    so the padding rows (never part of a group) are left unwritten and cut off.
  * weights laid out [E, K, N] (our MoE's layout, ``x @ w[e]``): no transpose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .tuning import _family, gpu_arch

BACKENDS = ("auto", "reference", "mgpu")

# Tiles in order of preference; the first whose block_k divides K and block_n
# divides N is taken. H200, jax 0.11.2, 2026-11-30 (bench/RESULTS.md): 64 x 256
# x 64 with 4 stages was the fastest of four tiles at every row count measured,
# for both 35B-A3B expert shapes (e.g. 2048 -> 1024 over 256 experts: 0.34 ms at
# 512 rows against 0.44 ms for 128 x 128; 0.54 ms against 0.68 ms at 16384 rows).
MGPU_TILES = (
    dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=1),
    dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
)


def grouped_matmul_reference(x, w, group_sizes):
    """x: [R, K] rows sorted by group; w: [E, K, N]; group_sizes: [E] int32 summing to <= R."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(x.dtype)


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


def resolve(backend: str = "auto") -> str:
    """"auto" -> "mgpu" on sm90 (the kernel uses Hopper's wgmma and TMA), else "reference"."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS}")
    if backend != "auto":
        return backend
    return "mgpu" if _family(gpu_arch()) == "sm90" else "reference"


def grouped_matmul(x, w, group_sizes, *, backend: str = "auto"):
    """``out[r] = x[r] @ w[g]`` for row r in group g (rows sorted by group);
    rows past sum(group_sizes) are zero (reference) or unwritten (kernel), so a
    caller must mask them (the MoE's expert-parallel path does). Falls back to
    the reference where the kernel does not fit (dtype, K or N off every tile)."""
    if resolve(backend) == "mgpu":
        tiles = mgpu_tiles(x, w)
        if tiles is not None:
            return padded_call(mgpu_kernel(), x, w, group_sizes, tiles)
        if backend == "mgpu":
            raise ValueError(f"mgpu grouped matmul does not take x {x.shape} {x.dtype}, "
                             f"w {w.shape} {w.dtype}")
    return grouped_matmul_reference(x, w, group_sizes)

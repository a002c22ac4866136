"""Grouped matmul for MoE experts: rows sorted by expert, one weight matrix each.

Backends:
  "auto"      -> on sm90 / sm100: the Pallas Triton kernel up to the routed-row count
                 the tuning table gives (decode and short prefill: it skips experts
                 without rows and reads a layer's experts in place from a stack of
                 layers), the Mosaic GPU kernel above it on sm90 (long prefill: wgmma
                 + TMA, also reading the stack in place), each where the shapes fit
                 it; the reference elsewhere (CPU) or where neither fits.
  "reference" -> ``jax.lax.ragged_dot`` (reference.py).
  "mgpu"      -> the Mosaic GPU kernel (mgpu.py; sm90).
  "pallas"    -> the Pallas Triton kernel compiled for the GPU (pallas_triton.py).
  "interpret" -> the same Pallas kernel body in interpret mode (any platform).

FP8 experts (``scale`` given) are W8A8 on every backend (block_fp8): the rows are
quantised in 128-entry groups here, and each kernel takes both operands as e4m3 (the
Pallas kernel widens them to bf16 in registers; the Mosaic one, ``mgpu_fp8.py``, feeds
them to FP8 wgmma), so a row's result does not depend on the batch size that picked the
kernel.
"""

from __future__ import annotations

import functools

from .._dispatch import default_backend
from ..block_fp8 import quantize_rows
from ..tuning import _family, gpu_arch, grouped_matmul_config, grouped_matmul_prefers_mgpu
from .mgpu import grouped_matmul_mgpu, mgpu_tiles, padded_call
from .mgpu_fp8 import FP8_TILES, fp8_tiles_fit, grouped_matmul_fp8_mgpu
from .pallas_triton import grouped_matmul_pallas, tiles_fit
from .reference import grouped_matmul_reference

BACKENDS = ("auto", "reference", "mgpu", "pallas", "interpret")


def resolve(backend: str = "auto", rows: int = 0) -> str:
    """The backend "auto" means for `rows` routed rows on this platform."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS}")
    if backend != "auto":
        return backend
    if default_backend.value == "reference" or _family(gpu_arch()) == "default":
        return "reference"
    return "mgpu" if grouped_matmul_prefers_mgpu(rows) else "pallas"


def grouped_matmul(x, w, group_sizes, *, group_offset=0, scale=None, splits: int = 1,
                   backend: str = "auto"):
    """``out[r] = x[r] @ w[group_offset + g]`` for row r in group g (rows sorted by
    group; ``w`` [G, K, N] may hold more groups than ``group_sizes`` [E], e.g. every
    layer's experts). An FP8 ``w`` is K-major ([G, N, K], block_fp8) and comes with its
    block scales ``scale`` and the number of parts on N that have their own blocks
    (``splits``: 2 for a fused [gate | up]); x is then quantised too (W8A8).
    Rows past sum(group_sizes) are zero (reference) or unwritten (kernels), so a caller
    must mask them (the MoE's expert-parallel path does). "auto" falls back to the
    reference where no kernel fits (dtype, K or N)."""
    chosen = resolve(backend, x.shape[0])
    lhs, kw = x, dict(group_offset=group_offset)
    if scale is not None:  # W8A8
        lhs, xs = quantize_rows(x)
        kw.update(scale=scale, splits=splits, x_scale=xs, out_dtype=x.dtype)
    if chosen in ("pallas", "interpret"):
        cfg = grouped_matmul_config(x.shape[0], fp8=scale is not None)
        if backend != "auto" or tiles_fit(lhs, w, cfg, scale, splits):
            return grouped_matmul_pallas(lhs, w, group_sizes, **kw,
                                         interpret=chosen == "interpret")
        chosen = "mgpu" if _family(gpu_arch()) == "sm90" else "reference"  # wgmma: sm90
    if chosen == "mgpu":
        if scale is not None:
            _, n, k = w.shape
            if fp8_tiles_fit(k, n, n // splits):
                kernel = functools.partial(grouped_matmul_fp8_mgpu, ws=scale, part=n // splits,
                                           out_dtype=x.dtype)
                return padded_call(kernel, (lhs, xs), w, group_sizes, group_offset, FP8_TILES)
        else:
            tiles = mgpu_tiles(x, w)
            if tiles is not None:
                return padded_call(grouped_matmul_mgpu, x, w, group_sizes, group_offset, tiles)
        if backend == "mgpu":
            raise ValueError(f"mgpu grouped matmul does not take x {x.shape} {x.dtype}, "
                             f"w {w.shape} {w.dtype}")
    return grouped_matmul_reference(lhs, w, group_sizes, **kw)

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

FP8 experts (``scale`` given: block_fp8) stay FP8 in the Pallas kernel; the Mosaic
kernel and the reference take the layer's experts dequantised by XLA, a copy that at
8,192 prefill tokens costs more than the bf16 matmul itself (bench/RESULTS.md, FP8
kernels), yet the pair is as fast or faster there than the Pallas kernel on the FP8
experts in place (bench/RESULTS.md, the whole 35B-A3B in FP8): an FP8 Mosaic kernel is
what would remove the copy.
"""

from __future__ import annotations

from .._dispatch import default_backend
from ..tuning import _family, gpu_arch, grouped_matmul_config, grouped_matmul_prefers_mgpu
from .mgpu import grouped_matmul_mgpu, mgpu_tiles, padded_call
from .pallas_triton import grouped_matmul_pallas, tiles_fit
from .reference import dequantized_groups, grouped_matmul_reference

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
    layer's experts). An FP8 ``w`` comes with its block scales ``scale`` and the number
    of parts on N that have their own blocks (``splits``: 2 for a fused [gate | up]).
    Rows past sum(group_sizes) are zero (reference) or unwritten (kernels), so a caller
    must mask them (the MoE's expert-parallel path does). "auto" falls back to the
    reference where no kernel fits (dtype, K or N)."""
    chosen = resolve(backend, x.shape[0])
    if chosen in ("pallas", "interpret"):
        cfg = grouped_matmul_config(x.shape[0])
        if backend != "auto" or tiles_fit(x, w, cfg, scale, splits):
            return grouped_matmul_pallas(x, w, group_sizes, group_offset, scale, splits,
                                         interpret=chosen == "interpret")
        chosen = "mgpu" if _family(gpu_arch()) == "sm90" else "reference"  # wgmma: sm90
    if chosen == "mgpu":
        if scale is not None:
            w = dequantized_groups(w, scale, group_sizes.shape[0], group_offset, x.dtype, splits)
            group_offset, scale = 0, None
        tiles = mgpu_tiles(x, w)
        if tiles is not None:
            return padded_call(grouped_matmul_mgpu, x, w, group_sizes, group_offset, tiles)
        if backend == "mgpu":
            raise ValueError(f"mgpu grouped matmul does not take x {x.shape} {x.dtype}, "
                             f"w {w.shape} {w.dtype}")
    return grouped_matmul_reference(x, w, group_sizes, group_offset, scale, splits)

"""``x @ w[layer]`` with w stacked over layers ([L, K, N]); ``layer_matmuls`` for the
projections of one x through several such weights (one launch for those read in place).

Backends:
  "auto"      -> on sm90 / sm100, for at most ``tuning.LAYER_MATMUL`` "max_rows" rows
                 (decode batches) and shapes the tiles fit, outside a mesh: the Pallas
                 kernel, which reads the layer in place; the reference otherwise
                 (prefill: cuBLAS beats a weight-streaming kernel there and the slice
                 is a small share; sharded programs: XLA partitions the dot).
  "reference" -> slice, then ``jnp.dot`` (reference.py).
  "pallas"    -> the Pallas Triton kernel compiled for the GPU (pallas_triton.py).
  "interpret" -> the same kernel body in interpret mode (any platform).

An FP8 ``w`` (``scale`` given: block_fp8) stays FP8 in the kernel; the reference
dequantises the layer's weight first.
"""
from __future__ import annotations

import jax

from .._dispatch import default_backend
from ..tuning import _family, gpu_arch, layer_matmul_config
from .pallas_triton import layer_matmul_pallas, tiles_fit
from .reference import layer_matmul_reference

BACKENDS = ("auto", "reference", "pallas", "interpret")


def resolve(backend: str, x, w, scale=None) -> str:
    """The backend "auto" means for these operands, here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS}")
    if backend != "auto":
        return backend
    if default_backend.value == "reference" or _family(gpu_arch()) == "default" or not jax.sharding.get_abstract_mesh().empty:
        return "reference"
    cfg = layer_matmul_config()
    return "pallas" if x.shape[0] <= cfg["max_rows"] and tiles_fit(x, w, cfg, scale) else "reference"


def layer_matmul(x, w, layer, *, scale=None, backend: str = "auto"):
    """x [M, K] @ w[layer] for w [L, K, N] and a traced or static layer index; an FP8
    ``w`` (block_fp8) comes with its block scales [L, K/128, N/128]."""
    return layer_matmuls(x, (w,), layer, scales=(scale,), backend=backend)[0]


def layer_matmuls(x, ws, layer, *, scales=None, backend: str = "auto"):
    """(x @ w[layer] for each w in ``ws``), the projections of one x: the weights the
    chosen backend reads in place share one launch, the others are sliced (reference).
    ``scales``: per weight, an FP8 weight's block scales or None."""
    scales = (None,) * len(ws) if scales is None else tuple(scales)
    chosen = [resolve(backend, x, w, s) for w, s in zip(ws, scales, strict=True)]
    fused = [j for j, c in enumerate(chosen) if c != "reference"]
    out = [layer_matmul_reference(x, w, layer, s) if c == "reference" else None
           for w, s, c in zip(ws, scales, chosen)]
    if fused:
        results = layer_matmul_pallas(x, [ws[j] for j in fused], layer,
                                      [scales[j] for j in fused],
                                      interpret=chosen[fused[0]] == "interpret")
        for j, r in zip(fused, results):
            out[j] = r
    return tuple(out)

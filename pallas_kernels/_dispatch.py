"""Backend selection shared by the GDN, conv1d and paged attention ops.

backend:
  "auto"      -> the fastest measured backend for the platform: the Pallas GPU
                 kernel on sm90 / sm100 (see BEST_GPU_BACKEND), the pure-JAX
                 reference elsewhere (CPU, TPU, other GPUs).
  "reference" -> pure JAX (chunked form for prefill).
  "recurrent" -> token-by-token reference (prefill only; slow, for checking).
  "pallas"    -> the Pallas Triton kernel bodies compiled for the GPU.
  "interpret" -> the same Pallas kernel bodies in interpret mode (any platform).
"""
from __future__ import annotations

from .tuning import gpu_arch, _family

# Filled from bench/kernels.py measurements (bench/RESULTS.md).  Per op and
# architecture family: which backend "auto" takes on that GPU.
BEST_GPU_BACKEND = {
    "gdn_prefill": {"sm90": "pallas", "sm100": "pallas"},
    "gdn_decode": {"sm90": "pallas", "sm100": "pallas"},
    "conv1d_prefill": {"sm90": "pallas", "sm100": "pallas"},
    "conv1d_update": {"sm90": "pallas", "sm100": "pallas"},
    "paged_attention": {"sm90": "pallas", "sm100": "pallas"},
}

BACKENDS = ("auto", "reference", "recurrent", "pallas", "interpret")


def resolve(op: str, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS}")
    if backend != "auto":
        return backend
    arch = gpu_arch()
    fam = _family(arch)
    if arch is not None and fam in ("sm90", "sm100"):
        return BEST_GPU_BACKEND[op].get(fam, "reference")
    return "reference"

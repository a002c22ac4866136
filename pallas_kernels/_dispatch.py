"""Backend selection shared by the GDN, conv1d and paged attention ops.

backend:
  "auto"      -> the fastest measured backend for the platform: the Pallas GPU
                 kernel on sm90 / sm100 (see BEST_GPU_BACKEND), the pure-JAX
                 reference elsewhere (CPU, TPU, other GPUs).
  "reference" -> pure JAX (chunked form for prefill).
  "recurrent" -> token-by-token reference (prefill only; slow, for checking).
  "pallas"    -> the Pallas kernels compiled for the GPU: the Triton bodies, or for a
                 16-bit GDN prefill on sm90 the Mosaic GPU pair (gdn/mgpu.py; the
                 tuning table's "main").
  "interpret" -> the same Pallas kernel bodies in interpret mode (any platform).

``default_backend`` names what "auto" stands for while a program is traced:
``with default_backend("interpret"):`` makes every GDN, conv1d and attention op
called with "auto" (the model's layers never pass a backend) run the Pallas
bodies in interpret mode, which is how the CPU tests run a whole sharded model on
the kernels.  It is a JAX user context, so a jitted function traced under another
value retraces.  The MoE grouped matmul and the stacked-layer matmul choose their
backends on their own, except under "reference", which makes them pure JAX as well:
the Pallas kernels have no VJP, so training (``qwen35_jax.train``) differentiates the
model under ``default_backend("reference")``.
"""
from __future__ import annotations

import jax

from .tuning import gpu_arch, _family

# The faster backend in bench/kernels.py's timings (bench/RESULTS.md).  Per op and
# architecture family: which backend "auto" takes on that GPU.
BEST_GPU_BACKEND = {
    "gdn_prefill": {"sm90": "pallas", "sm100": "pallas"},
    "gdn_decode": {"sm90": "pallas", "sm100": "pallas"},
    "conv1d_prefill": {"sm90": "pallas", "sm100": "pallas"},
    "conv1d_update": {"sm90": "pallas", "sm100": "pallas"},
    "paged_attention": {"sm90": "pallas", "sm100": "pallas"},
}

BACKENDS = ("auto", "reference", "recurrent", "pallas", "interpret")

default_backend = jax.make_user_context("auto")


def resolve(op: str, backend: str) -> str:
    if backend == "auto":
        backend = default_backend.value
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS}")
    if backend != "auto":
        return backend
    arch = gpu_arch()
    fam = _family(arch)
    if arch is not None and fam in ("sm90", "sm100"):
        return BEST_GPU_BACKEND[op].get(fam, "reference")
    return "reference"

"""Pallas kernels for qwen35-jax (GPU kernels with pure-JAX references).

GDN and conv1d ops are exported here; attention kernels live in
``pallas_kernels.attention`` (imported on demand).  ``default_backend`` sets
the backend that these ops, called with "auto", take while a program is traced.
"""
from ._dispatch import default_backend
from .conv1d import causal_conv1d_prefill, causal_conv1d_update
from .gdn import (
    gdn_chunked_reference,
    gdn_decode,
    gdn_decode_reference,
    gdn_prefill,
    gdn_recurrent_reference,
)

__all__ = [
    "default_backend", "gdn_prefill", "gdn_decode", "gdn_chunked_reference",
    "gdn_recurrent_reference", "gdn_decode_reference", "causal_conv1d_prefill",
    "causal_conv1d_update",
]

"""Gated DeltaNet kernels: chunked prefill and pooled decode."""
from .ops import gdn_decode, gdn_prefill
from .reference import (
    chunk_table,
    gdn_chunked_reference,
    gdn_decode_reference,
    gdn_recurrent_reference,
)

__all__ = [
    "gdn_prefill", "gdn_decode", "gdn_chunked_reference", "gdn_recurrent_reference",
    "gdn_decode_reference", "chunk_table",
]

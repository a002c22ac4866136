"""Attention over a paged KV cache: the Pallas kernels (GPU) and the reference
(CPU, and the oracle for the kernels), dispatched by ``ops.paged_attention``."""

from pallas_kernels.attention.ops import paged_attention
from pallas_kernels.attention.reference import paged_attention_reference, write_kv

__all__ = ["paged_attention", "paged_attention_reference", "write_kv"]

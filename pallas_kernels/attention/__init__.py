"""Attention over a paged KV cache: the reference (CPU, and the oracle for kernels)."""

from pallas_kernels.attention.reference import paged_attention_reference, write_kv

paged_attention = paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference", "write_kv"]

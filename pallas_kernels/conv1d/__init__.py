"""Short causal depthwise conv1d (before GDN): packed prefill and pooled update."""
from .ops import causal_conv1d_prefill, causal_conv1d_update
from .reference import causal_conv1d_prefill_reference, causal_conv1d_update_reference

__all__ = ["causal_conv1d_prefill", "causal_conv1d_update",
           "causal_conv1d_prefill_reference", "causal_conv1d_update_reference"]

"""Qwen3.5 layers: norms, RoPE, gated attention, Gated DeltaNet, dense and MoE FFN."""

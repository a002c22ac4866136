"""Partial rotary embedding (NeoX rotate-half) on the first ``rotary_dim`` dims.

Qwen3.5's interleaved M-RoPE reduces to plain 1-D RoPE for text, where the
three position rows are equal, so only positions are needed here.
"""

from __future__ import annotations

import jax.numpy as jnp


def apply_partial_rope(x, positions, *, rotary_dim: int, theta: float):
    """x: [T, heads, head_dim]; positions: [T] int.  cos/sin cast to x's dtype as in HF."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)

"""SwiGLU feed-forward: ``down(SiLU(gate(x)) * up(x))``, no biases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(inter, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x, layer=None):
        """`layer`: the flat layer index when the weights are stacked (``Linear``)."""
        h = jax.nn.silu(self.gate_proj(x, layer)) * self.up_proj(x, layer)
        return self.down_proj(h, layer)

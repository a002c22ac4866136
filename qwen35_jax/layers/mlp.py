"""SwiGLU feed-forward: ``down(SiLU(gate(x)) * up(x))``, no biases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.layers.linear import Linear, project


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(hidden, inter, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(inter, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x, layer=None):
        """`layer`: the flat layer index when the weights are stacked (``Linear``)."""
        return self.down(*project(x, layer, self.gate_proj, self.up_proj), layer)

    def down(self, gate, up, layer=None):
        """The block from its gate and up projections (a caller that projects x through
        more Linears at once, the MoE's shared expert, starts here)."""
        return self.down_proj(jax.nn.silu(gate) * up, layer)

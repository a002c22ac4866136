"""SwiGLU feed-forward: ``down(SiLU(gate(x)) * up(x))``, no biases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def linear(din, dout, rngs, dtype):
    return nnx.Linear(din, dout, use_bias=False, param_dtype=dtype, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = linear(hidden, inter, rngs, dtype)
        self.up_proj = linear(hidden, inter, rngs, dtype)
        self.down_proj = linear(inter, hidden, rngs, dtype)

    def __call__(self, x, layer=None):
        """`layer` is unused: the MoE block, which takes the same call, needs it."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

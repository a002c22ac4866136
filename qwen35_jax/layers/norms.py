"""The two RMSNorms of Qwen3.5.

Everywhere but the GDN output the weight is zero-centred, ``x̂·(1+w)``; the GDN
output norm has a plain weight and is gated, ``x̂·w·SiLU(z)``.  Mixing them up
gives O(1) logit errors, so each has its own class.  Cast points follow HF:
normalise in float32, cast back to the activation dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _normalise(x, eps):
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: ``x·rsqrt(mean x²+eps)·(1+w)``, weight initialised to 0."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x):
        return (_normalise(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: normalise, cast, times a plain weight, times SiLU(z) in float32."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x, z):
        y = self.weight[...] * _normalise(x, self.eps).astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)

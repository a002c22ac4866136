"""The portable form: slice the layer out of the stack (dequantised if FP8), then an XLA
dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..block_fp8 import dequantize


def layer_matmul_reference(x, w, layer, scale=None):
    """x [M, K], w [L, K, N], layer: scalar index -> x @ w[layer] (dtype as ``jnp.dot``);
    an FP8 ``w`` with block scales [L, K/128, N/128] is dequantised to x's dtype first."""
    layer = jnp.asarray(layer, jnp.int32)
    wl = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
    if scale is not None:
        wl = dequantize(wl, jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False),
                        x.dtype)
    return jnp.dot(x, wl)

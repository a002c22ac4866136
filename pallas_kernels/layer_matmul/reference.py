"""The portable form: slice the layer out of the stack, then an XLA dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_matmul_reference(x, w, layer):
    """x [M, K], w [L, K, N], layer: scalar index -> x @ w[layer] (dtype as ``jnp.dot``)."""
    return jnp.dot(x, jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), 0,
                                                   keepdims=False))

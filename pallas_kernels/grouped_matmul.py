"""Grouped matmul for MoE experts: rows sorted by expert, one weight matrix each.

``jax.lax.ragged_dot`` is the portable path (CPU, and the oracle); on Hopper it
runs about 90x slower than JAX's Mosaic GPU grouped matmul (anchors.md), so the
GPU dispatch uses that kernel when it is importable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(x, w, group_sizes):
    """x: [R, K] rows sorted by group; w: [E, K, N]; group_sizes: [E] int32 summing to <= R."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def grouped_matmul(x, w, group_sizes):
    """Dispatch: the reference everywhere for now (a GPU kernel replaces it on sm90)."""
    return grouped_matmul_reference(x, w, group_sizes)

"""The portable grouped matmul (CPU, and the oracle the kernels are checked against)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_groups(w, num_groups: int, group_offset):
    """``w[group_offset : group_offset + num_groups]``: one layer's experts out of a stack
    of several layers' (the kernels index the stack instead of copying the slice out)."""
    if w.shape[0] == num_groups:
        return w
    return jax.lax.dynamic_slice_in_dim(w, jnp.asarray(group_offset, jnp.int32), num_groups, 0)


def grouped_matmul_reference(x, w, group_sizes, group_offset=0):
    """x: [R, K] rows sorted by group; w: [G, K, N]; group_sizes: [E] int32 summing to <= R;
    group e uses ``w[group_offset + e]``. Rows past sum(group_sizes) are zero."""
    w = select_groups(w, group_sizes.shape[0], group_offset)
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(x.dtype)

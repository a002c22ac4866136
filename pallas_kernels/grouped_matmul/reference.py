"""The portable grouped matmul (CPU, and the oracle the kernels are checked against)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..block_fp8 import dequantize


def select_groups(w, num_groups: int, group_offset):
    """``w[group_offset : group_offset + num_groups]``: one layer's experts out of a stack
    of several layers' (the kernels index the stack instead of copying the slice out)."""
    if w.shape[0] == num_groups:
        return w
    return jax.lax.dynamic_slice_in_dim(w, jnp.asarray(group_offset, jnp.int32), num_groups, 0)


def dequantized_groups(w, scale, num_groups: int, group_offset, dtype, splits: int = 1):
    """One layer's FP8 experts out of the stack, dequantised to ``dtype``."""
    return dequantize(select_groups(w, num_groups, group_offset),
                      select_groups(scale, num_groups, group_offset), dtype, splits)


def grouped_matmul_reference(x, w, group_sizes, group_offset=0, scale=None, splits: int = 1):
    """x: [R, K] rows sorted by group; w: [G, K, N]; group_sizes: [E] int32 summing to <= R;
    group e uses ``w[group_offset + e]``, dequantised first if FP8 (``scale``: its block
    scales, ``splits`` parts on N). Rows past sum(group_sizes) are zero."""
    if scale is None:
        w = select_groups(w, group_sizes.shape[0], group_offset)
    else:
        w = dequantized_groups(w, scale, group_sizes.shape[0], group_offset, x.dtype, splits)
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(x.dtype)

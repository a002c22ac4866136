"""The portable grouped matmul (CPU, and the oracle the kernels are checked against)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..block_fp8 import dequantize_k_major, dequantize_rows


def select_groups(w, num_groups: int, group_offset):
    """``w[group_offset : group_offset + num_groups]``: one layer's experts out of a stack
    of several layers' (the kernels index the stack instead of copying the slice out)."""
    if w.shape[0] == num_groups:
        return w
    return jax.lax.dynamic_slice_in_dim(w, jnp.asarray(group_offset, jnp.int32), num_groups, 0)


def dequantized_groups(w, scale, num_groups: int, group_offset, dtype, splits: int = 1):
    """One layer's FP8 experts (K-major, block_fp8) out of the stack, dequantised to
    ``dtype`` as [E, K, N]."""
    return dequantize_k_major(select_groups(w, num_groups, group_offset),
                              select_groups(scale, num_groups, group_offset), dtype, splits)


def grouped_matmul_reference(x, w, group_sizes, group_offset=0, scale=None, splits: int = 1,
                             *, x_scale=None, out_dtype=None):
    """x: [R, K] rows sorted by group; w: [G, K, N]; group_sizes: [E] int32 summing to <= R;
    group e uses ``w[group_offset + e]``. Rows past sum(group_sizes) are zero.
    W8A8 (``scale`` given, block_fp8): x is e4m3 with its group scales ``x_scale``, w
    K-major [G, N, K] with block scales (``splits`` parts on N); both are dequantised to
    float32 first, and the result is ``out_dtype``."""
    out_dtype = out_dtype or x.dtype
    if scale is None:
        w = select_groups(w, group_sizes.shape[0], group_offset)
    else:
        w = dequantized_groups(w, scale, group_sizes.shape[0], group_offset, jnp.float32, splits)
        x = dequantize_rows(x, x_scale, jnp.float32)
    out = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)

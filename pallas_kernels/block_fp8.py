"""The block-scaled FP8 operand the matmul kernels take: Qwen's -FP8 layout.

A quantised weight is float8 e4m3 values ``q`` and one float32 scale per 128 x 128
block (the checkpoints' ``weight_scale_inv``): ``w = q * scale[block]``. The scale of a
block is its largest magnitude over 448 (e4m3's largest finite value), so the block's
largest entry maps to +-448 and nothing saturates; an all-zero block has scale 1. Edge
blocks are partial (a dimension that is not a multiple of 128).

Weights here are in the kernels' [..., in, out] layout, the transpose of the
checkpoints' [out, in]: the rule is symmetric, so the scales are the transposed
``weight_scale_inv``. A fused tensor of ``splits`` weights side by side on its out axis
(the experts' [gate | up]) keeps each part's blocks: its scale holds each part's block
columns in turn (``column_block``).

The dense kernels dequantise a tile in registers (a tile lies in one block:
``tile_fits``) and scale its float32 partial product, so a weight stays FP8 in memory:
half the bytes of a bf16 weight stream.

MoE experts are W8A8 and K-major. Their FP8 tensors are held [..., out, in] with scales
[..., out blocks, in blocks] (``k_major``; the checkpoints' own layout), because the
tensor cores read 8-bit operands only with K contiguous. The rows multiplied by them are
quantised too (``quantize_rows``: per row, in 128-entry groups of K, as the -FP8
checkpoints' inference code quantises activations), on every backend, so a token's
result does not depend on which kernel its batch size picked; each 128-deep step of a
product then has one row scale and one weight scale, and the kernels multiply e4m3 by
e4m3.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def is_fp8(x) -> bool:
    return jnp.dtype(x.dtype) == jnp.dtype(FP8)


def scale_shape(shape, splits: int = 1) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, blocks(rows), splits * blocks(cols // splits))


def column_block(col, part: int):
    """The scale column of weight column ``col`` (static or traced) in a tensor whose
    out axis is parts of ``part`` columns, each with its own blocks."""
    j = col // part
    return j * blocks(part) + (col - j * part) // BLOCK


def tile_fits(bk: int, bn: int, k: int, n: int, part: int) -> bool:
    """A bk x bn tile starting at a multiple of its size lies in one scale block (and one
    part), and K, N are whole tiles."""
    return (BLOCK % bk == 0 and BLOCK % bn == 0 and part % bn == 0
            and k % bk == 0 and n % bn == 0)


def _expand(scale, rows: int, cols: int, splits: int):
    """Per-block scales [..., bi, splits * bo] -> per-entry [..., rows, cols]."""
    xp = np if isinstance(scale, np.ndarray) else jnp
    s = xp.repeat(scale, BLOCK, axis=-2)[..., :rows, :]
    part = cols // splits
    nb = scale.shape[-1] // splits
    return xp.concatenate([xp.repeat(s[..., j * nb:(j + 1) * nb], BLOCK, axis=-1)[..., :part]
                           for j in range(splits)], axis=-1)


def quantize(w, splits: int = 1):
    """w [..., in, out] -> (q float8 e4m3 [..., in, out], scale float32 [..., in/128,
    splits * out/splits/128], blocks rounded up).

    A NumPy ``w`` is quantised in NumPy, whose float32 division is IEEE's, so the result
    is bit for bit that of the checkpoints' quantisers (PyTorch's); the loader quantises
    that way. A JAX array stays on its device (random weights for benchmarks): XLA's
    CPU division can be an ulp off, so a scale there may differ in its last bit."""
    xp = np if isinstance(w, np.ndarray) else jnp
    fp8 = ml_dtypes.float8_e4m3fn if xp is np else FP8
    *lead, rows, cols = w.shape
    if cols % splits:
        raise ValueError(f"{cols} columns do not split into {splits} equal parts")
    w = w.astype(np.float32)
    part = cols // splits
    pr, pc = blocks(rows) * BLOCK - rows, blocks(part) * BLOCK - part
    amax = []
    for j in range(splits):
        x = xp.pad(xp.abs(w[..., j * part:(j + 1) * part]),
                   [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
        x = x.reshape(*lead, blocks(rows), BLOCK, blocks(part), BLOCK)
        amax.append(xp.max(x, axis=(-3, -1)))
    amax = xp.concatenate(amax, axis=-1)
    scale = xp.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = (w / _expand(scale, rows, cols, splits)).astype(fp8)
    return q, scale


def k_major(q, scale):
    """A quantised [..., in, out] weight and its scales in the K-major expert layout:
    [..., out, in] and [..., out blocks, in blocks]."""
    return q.swapaxes(-1, -2), scale.swapaxes(-1, -2)


def dequantize_k_major(q, scale, dtype, splits: int = 1):
    """A K-major FP8 weight [..., out, in] -> [..., in, out] in ``dtype``."""
    return dequantize(q.swapaxes(-1, -2), scale.swapaxes(-1, -2), dtype, splits)


def quantize_rows(x):
    """x [R, K] -> (e4m3 [R, K], float32 scales [R, K/128 rounded up]): each row's
    128-entry groups, the activations' side of W8A8 (the -FP8 checkpoints' inference
    code quantises a token's activations this way, in groups matching the weight's
    input blocks). A group's scale is its largest magnitude / 448 (all zero: 1); the
    scaled largest entry may land an ulp above 448, which e4m3 rounds to 448."""
    r, k = x.shape
    x = x.astype(jnp.float32)
    g = jnp.pad(x, ((0, 0), (0, blocks(k) * BLOCK - k))).reshape(r, blocks(k), BLOCK)
    amax = jnp.max(jnp.abs(g), axis=-1)
    scale = jnp.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0))
    return (x / jnp.repeat(scale, BLOCK, axis=1)[:, :k]).astype(FP8), scale


def dequantize_rows(q, scale, dtype):
    """The inverse of ``quantize_rows``: q * its group's scale, in ``dtype``."""
    s = jnp.repeat(scale, BLOCK, axis=1)[:, :q.shape[1]]
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize(q, scale, dtype, splits: int = 1):
    """q [..., in, out] float8 and its block scales -> [..., in, out] in ``dtype``."""
    s = _expand(scale, q.shape[-2], q.shape[-1], splits)
    return (q.astype(jnp.float32) * s).astype(dtype)

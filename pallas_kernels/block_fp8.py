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

The kernels dequantise a tile in registers (a tile lies in one block: ``tile_fits``)
and scale its float32 partial product, so a weight stays FP8 in memory: half the bytes
of a bf16 weight stream.
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


def dequantize(q, scale, dtype, splits: int = 1):
    """q [..., in, out] float8 and its block scales -> [..., in, out] in ``dtype``."""
    s = _expand(scale, q.shape[-2], q.shape[-1], splits)
    return (q.astype(jnp.float32) * s).astype(dtype)

"""The matmul kernels on FP8 weights with 128 x 128 block scales (pallas_kernels/
block_fp8.py): the Pallas kernel bodies in interpret mode and the references against a
float64 oracle that applies the block-scale rule entry by entry. Blocks differ in
magnitude by up to 10^4, so a tile scaled by another block's scale is far off; K and N
span whole and partial blocks; the fused [gate | up] has partial blocks in each part.
The compiled kernels run on sm90; bench/layer_matmul.py and bench/grouped_matmul.py
check them there against the dequantised product."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import block_fp8
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_pallas


def _fp8_weights(rng, lead, k, n, splits=1):
    """Random [lead, K, N] weights whose 128 x 128 blocks (per part) span 10^-2..10^2,
    quantised in NumPy: (q, scale)."""
    part = n // splits
    mag = 10.0 ** rng.uniform(-2, 2, (lead, block_fp8.blocks(k), splits * block_fp8.blocks(part)))
    w = rng.standard_normal((lead, k, n))
    for j in range(splits):
        cols = np.arange(part)
        w[:, :, j * part:(j + 1) * part] *= np.repeat(
            mag[:, :, j * block_fp8.blocks(part) + cols // 128], 128, axis=1)[:, :k]
    return block_fp8.quantize(w.astype(np.float32), splits)


def _dequantized(q, scale, splits=1):
    """The block-scale rule in float64, entry by entry: w[i, j] = q[i, j] * s[i // 128,
    the block of column j within its part]."""
    *_, k, n = q.shape
    part = n // splits
    rows = np.arange(k) // 128
    cols = (np.arange(n) // part) * (-(-part // 128)) + (np.arange(n) % part) // 128
    return np.asarray(q, np.float64) * np.asarray(scale, np.float64)[..., rows[:, None], cols[None, :]]


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,k,n", [(5, 288, 160), (16, 128, 272), (33, 160, 16)])
def test_layer_matmul_streams_fp8_tiles_with_their_block_scales(m, k, n, dtype, bound):
    """Every layer of a 3-layer FP8 stack; K and N of whole and partial blocks, narrow
    outputs that split K over programs (their partial sums each scaled per block)."""
    rng = np.random.default_rng(m + k + n)
    q, scale = _fp8_weights(rng, 3, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    wq, ws = jnp.asarray(q), jnp.asarray(scale)
    fn = jax.jit(lambda a, b, s, l: layer_matmul(a, b, l, scale=s, backend="interpret"))
    for layer in range(3):
        ref = np.asarray(x, np.float64) @ _dequantized(q[layer], scale[layer])
        assert _rel(fn(x, wq, ws, layer), ref) < bound, layer
        assert _rel(layer_matmul(x, wq, layer, scale=ws, backend="reference"), ref) < bound


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("splits,n", [(1, 272), (2, 320)])
def test_grouped_matmul_streams_fp8_experts_with_their_block_scales(splits, n, dtype, bound):
    """FP8 experts stacked over 3 layers (every layer's offset, an empty expert, rows past
    the groups), a plain and a fused [gate | up] tensor (two parts of 160 columns: each
    part's blocks are its own, the second starting mid-128)."""
    rng = np.random.default_rng(n)
    experts, layers, rows, k = 4, 3, 40, 160
    q, scale = _fp8_weights(rng, layers * experts, k, n, splits)
    owned = rows - 3
    sizes = rng.multinomial(owned, np.r_[0.4, 0, 0.3, 0.3]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = _dequantized(q, scale, splits)
    fn = jax.jit(lambda a, b, s, g, o, backend: grouped_matmul(
        a, b, g, group_offset=o, scale=s, splits=splits, backend=backend),
        static_argnames="backend")
    group = np.repeat(np.arange(experts), sizes)
    for layer in range(layers):
        ref = np.stack([np.asarray(x[r], np.float64) @ w[layer * experts + g]
                        for r, g in enumerate(group)])
        for backend in ("interpret", "reference"):
            out = fn(x, jnp.asarray(q), jnp.asarray(scale), jnp.asarray(sizes),
                     layer * experts, backend)
            assert _rel(np.asarray(out, np.float64)[:owned], ref) < bound, (layer, backend)


def test_tiles_across_a_scale_block_are_refused():
    """A tile that would span two scale blocks (or both parts of a fused tensor) cannot
    take one scale: the kernel refuses rather than scale part of it wrongly; "auto"
    falls back to the reference."""
    q, scale = _fp8_weights(np.random.default_rng(0), 1, 128, 96, splits=2)
    x = jnp.ones((4, 128), jnp.float32)
    wide = dict(bn=96, bk=16, warps=4, stages=2, min_programs=1, max_rows=256)
    with pytest.raises(ValueError, match="do not fit"):
        layer_matmul_pallas(x, jnp.asarray(q), 0, jnp.asarray(scale), interpret=True,
                            config=wide)
    assert not block_fp8.tile_fits(16, 32, 128, 96, 48)  # a 32-wide tile straddles the parts
    assert block_fp8.tile_fits(16, 16, 128, 96, 48)


"""The matmul kernels on FP8 weights with 128 x 128 block scales (pallas_kernels/
block_fp8.py): the Pallas kernel bodies in interpret mode and the references against a
float64 oracle that applies the block-scale rule entry by entry. Blocks differ in
magnitude by up to 10^4, so a tile scaled by another block's scale is far off; K and N
span whole and partial blocks; the fused [gate | up] has partial blocks in each part.
The experts are W8A8: their rows are quantised in 128-entry groups, whose magnitudes
differ too. The compiled kernels run on sm90: the Mosaic FP8 grouped matmul in the
``gpu``-marked test here, the rest in bench/fp8_matmul.py, against the dequantised
product."""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from mosaic_runner import need_runner
from pallas_kernels import block_fp8
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_pallas, layer_matmuls


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


def test_fp8_and_model_dtype_projections_share_a_launch():
    """An FP8 weight (its own block scales) and a model-dtype one read by the same rows,
    as an FP8 model's router and shared-expert projections are, in one launch: each
    product by its own rule."""
    rng = np.random.default_rng(7)
    q, scale = _fp8_weights(rng, 2, 160, 272)
    w = rng.standard_normal((2, 160, 32))
    x = jnp.asarray(rng.standard_normal((6, 160)), jnp.float32)
    args = ([jnp.asarray(w, jnp.float32), jnp.asarray(q)], [None, jnp.asarray(scale)])
    fn = jax.jit(lambda a, ws, ss, l: layer_matmuls(a, ws, l, scales=ss, backend="interpret"))
    assert str(jax.make_jaxpr(fn)(x, *args, 1)).count("pallas_call") == 1
    dense, fp8 = fn(x, *args, 1)
    assert _rel(dense, np.asarray(x, np.float64) @ w[1]) < 1e-6
    assert _rel(fp8, np.asarray(x, np.float64) @ _dequantized(q[1], scale[1])) < 1e-6


def _rows(rng, rows, k, dtype):
    """Rows whose 128-entry groups span 10^-2..10^2, so a product scaled by another
    group's scale is far off."""
    mag = np.repeat(10.0 ** rng.uniform(-2, 2, (rows, block_fp8.blocks(k))), 128, axis=1)
    return jnp.asarray(rng.standard_normal((rows, k)) * mag[:, :k], dtype)


def test_rows_quantise_per_group_as_numpy_does():
    """Each row's 128-entry groups (the last one partial) scale to their largest
    magnitude / 448, an all-zero group to 1; the values are e4m3's rounding (ml_dtypes)
    of x / scale, and dequantise to q * scale."""
    rng = np.random.default_rng(0)
    x = np.array(_rows(rng, 6, 300, jnp.float32))
    x[2, 128:256] = 0.0
    q, s = block_fp8.quantize_rows(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (6, 3)
    for r in range(6):
        for b in range(3):
            g = x[r, b * 128:(b + 1) * 128]
            want = np.float32(np.abs(g).max() / np.float32(448.0)) if np.abs(g).max() else 1.0
            assert np.asarray(s)[r, b] == pytest.approx(want, rel=2 ** -23), (r, b)
            np.testing.assert_array_equal(
                np.asarray(q)[r, b * 128:(b + 1) * 128].view(np.uint8),
                (g / np.asarray(s)[r, b]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.asarray(s)[2, 1] == 1.0 and np.abs(np.asarray(q, np.float32)).max() == 448.0
    back = np.asarray(block_fp8.dequantize_rows(q, s, jnp.float32))
    np.testing.assert_array_equal(back, np.asarray(q, np.float32) * np.repeat(
        np.asarray(s), 128, axis=1)[:, :300])


def _w8a8_case(rng, splits, n, dtype, k=160, experts=4, layers=3, rows=40):
    """K-major FP8 experts stacked over layers, rows (3 past the groups) and their
    float64 oracle per layer: the dequantised rows times the dequantised weights."""
    q, scale = _fp8_weights(rng, layers * experts, k, n, splits)
    owned = rows - 3
    sizes = rng.multinomial(owned, np.r_[0.4, 0, 0.3, 0.3][:experts]).astype(np.int32)
    x = _rows(rng, rows, k, dtype)
    xq, xs = block_fp8.quantize_rows(x)
    xd = np.asarray(block_fp8.dequantize_rows(xq, xs, jnp.float32), np.float64)
    w = _dequantized(q, scale, splits)
    group = np.repeat(np.arange(experts), sizes)
    refs = [np.stack([xd[r] @ w[layer * experts + g] for r, g in enumerate(group)])
            for layer in range(layers)]
    qt, st = block_fp8.k_major(jnp.asarray(q), jnp.asarray(scale))
    return x, qt, st, jnp.asarray(sizes), owned, refs


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("splits,n", [(1, 272), (2, 320)])
def test_grouped_matmul_is_w8a8_on_fp8_experts(splits, n, dtype, bound):
    """FP8 experts stacked over 3 layers (every layer's offset, an empty expert, rows past
    the groups), a plain and a fused [gate | up] tensor (two parts of 160 columns: each
    part's blocks are its own, the second starting mid-128): the rows' and the weights'
    scales each applied to their own 128-deep step."""
    x, qt, st, sizes, owned, refs = _w8a8_case(np.random.default_rng(n), splits, n, dtype)
    fn = jax.jit(lambda a, b, s, g, o, backend: grouped_matmul(
        a, b, g, group_offset=o, scale=s, splits=splits, backend=backend),
        static_argnames="backend")
    for layer, ref in enumerate(refs):
        for backend in ("interpret", "reference"):
            out = fn(x, qt, st, sizes, layer * 4, backend)
            assert out.dtype == dtype
            assert _rel(np.asarray(out, np.float64)[:owned], ref) < bound, (layer, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,n,k", [(1, 256, 384), (2, 512, 256)])
def test_mosaic_fp8_grouped_matmul_matches_oracle(splits, n, k):
    """The Mosaic kernel (FP8 wgmma, a fresh accumulator a 128-deep step): rows off
    the 64-row grid, an empty expert, three layers' experts stacked, a fused tensor."""
    runner = need_runner()
    x, qt, st, sizes, owned, refs = _w8a8_case(np.random.default_rng(k), splits, n,
                                               jnp.bfloat16, k=k, rows=100)
    with runner:
        for layer, ref in enumerate(refs):
            out = grouped_matmul(x, qt, sizes, group_offset=layer * 4, scale=st,
                                 splits=splits, backend="mgpu")
            assert _rel(np.asarray(out, np.float64)[:owned], ref) < 1e-2, layer


def test_tiles_across_a_scale_block_are_refused():
    """A tile that would span two scale blocks (or both parts of a fused tensor) cannot
    take one scale: the kernel refuses rather than scale part of it wrongly; "auto"
    falls back to the reference."""
    q, scale = _fp8_weights(np.random.default_rng(0), 1, 128, 96, splits=2)
    x = jnp.ones((4, 128), jnp.float32)
    wide = dict(bn=96, bk=16, warps=4, stages=2, min_programs=1, max_rows=256)
    with pytest.raises(ValueError, match="do not fit"):
        layer_matmul_pallas(x, [jnp.asarray(q)], 0, [jnp.asarray(scale)], interpret=True,
                            config=wide)
    assert not block_fp8.tile_fits(16, 32, 128, 96, 48)  # a 32-wide tile straddles the parts
    assert block_fp8.tile_fits(16, 16, 128, 96, 48)


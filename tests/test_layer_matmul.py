"""x @ w[layer] over a stack of layers: the Pallas kernel body (interpret mode) and the
reference against a float64 oracle, and the Linear layer that calls it with a stacked
kernel. The compiled kernel runs only on sm90 / sm100; bench/decode_step.py measures it
in the model there."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_pallas, layer_matmuls, resolve
from pallas_kernels.layer_matmul.pallas_triton import splits_for, tiles_fit
from pallas_kernels.tuning import layer_matmul_config
from qwen35_jax.layers import linear as linear_module
from qwen35_jax.layers.linear import Linear


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("m,k,n", [(1, 32, 48), (16, 64, 16), (37, 128, 64), (130, 32, 32),
                                   (8, 32, 128)])
def test_kernel_reads_each_layer_of_the_stack(m, k, n, dtype, bound):
    """Every layer of a 3-layer stack, row counts below / off / above a power of two
    (the wrapper pads), narrow outputs that split K over programs and a wide one that
    does not (8 column tiles: one split)."""
    rng = np.random.default_rng(m * n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((3, k, n)), dtype)
    fn = jax.jit(lambda a, b, l: layer_matmul(a, b, l, backend="interpret"))
    for layer in range(3):
        ref = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        assert _rel(fn(x, w, layer), ref) < bound, layer
        assert _rel(layer_matmul(x, w, layer, backend="reference"), ref) < bound, layer


def test_k_splits_give_enough_programs():
    cfg = layer_matmul_config()  # CPU: 16-wide tiles, at least 8 programs
    assert splits_for(1, 64, cfg) == 4           # 1 column tile -> 4 splits of 16
    assert splits_for(1, 32, cfg) == 2           # K allows no more
    assert splits_for(16, 64, cfg) == 1          # 16 column tiles already
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)
    assert _rel(layer_matmul_pallas(x, [w], 1, interpret=True)[0], ref) < 1e-6


def _pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize("m,k", [(3, 64), (20, 128)])
def test_projections_of_one_x_share_a_launch(m, k, monkeypatch):
    """Weights of 16, 48 and 32 columns (1 + 3 + 2 column tiles: 6 programs a split, so
    K splits too) in one launch, each its own layer's product; a weight the backend
    slices ("auto" does so for one no tile fits) keeps its place in the results."""
    from pallas_kernels.layer_matmul import ops

    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32) for n in (16, 24, 48, 32)]
    monkeypatch.setattr(ops, "resolve", lambda backend, x, w, scale: (
        "reference" if w.shape[2] == 24 else "interpret"))
    fn = jax.jit(lambda a, w, l: layer_matmuls(a, w, l))
    assert _pallas_calls(fn, x, ws, 0) == 1
    for layer in (0, 2):
        outs = fn(x, ws, layer)
        assert [o.shape for o in outs] == [(m, w.shape[2]) for w in ws]
        for out, w in zip(outs, ws):
            ref = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
            assert _rel(out, ref) < 1e-6, (layer, w.shape)


def test_outputs_narrower_than_a_tile_take_their_own_width():
    """With 32-wide tiles, a 16-wide output (a power of two below the tile: the GDN's
    b / a projections beside qkv / z) is one tile of its own width in the shared launch;
    24 (no power of two) and 8 (below 16) fit no tile."""
    cfg = dict(bn=32, bk=16, warps=4, stages=2, min_programs=4, max_rows=256)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((2, 32, n)), jnp.float32) for n in (64, 16, 16)]
    outs = layer_matmul_pallas(x, ws, 1, interpret=True, config=cfg)
    for out, w in zip(outs, ws):
        assert _rel(out, np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)) < 1e-6
    for n in (24, 8):
        assert not tiles_fit(x, jnp.zeros((2, 32, n), jnp.float32), cfg)


def test_tiles_that_do_not_fit_are_refused():
    x = jnp.zeros((4, 30), jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        layer_matmul_pallas(x, [jnp.zeros((2, 30, 16), jnp.float32)], 0, interpret=True)
    with pytest.raises(ValueError, match="unknown backend"):
        layer_matmul(x, jnp.zeros((2, 30, 16), jnp.float32), 0, backend="triton")


def test_auto_choice(monkeypatch):
    """On an sm90 GPU "auto" reads in place at decode sizes, slices for prefill sizes
    and inside a mesh (where XLA partitions the dot); on CPU it is the reference."""
    x, w = jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((2, 128, 256), jnp.bfloat16)
    if jax.default_backend() == "cpu":
        assert resolve("auto", x, w) == "reference"
    assert resolve("interpret", x, w) == "interpret"
    from pallas_kernels import tuning
    from pallas_kernels.layer_matmul import ops

    monkeypatch.setattr(ops, "gpu_arch", lambda: "sm90")
    monkeypatch.setattr(tuning, "gpu_arch", lambda: "sm90")
    assert resolve("auto", x, w) == "pallas"
    assert resolve("auto", jnp.zeros((512, 128), jnp.bfloat16), w) == "reference"
    assert resolve("auto", x.astype(jnp.float32), w) == "reference"  # dtypes differ
    mesh = jax.make_mesh((1,), ("tensor",))
    with jax.set_mesh(mesh):
        assert resolve("auto", x, w) == "reference"


def test_linear_with_a_stacked_kernel(monkeypatch):
    """A Linear merged with a [2, 3, in, out] stack (as the scanned model passes it) gives
    x @ kernel[g, j] for flat index g * 3 + j, through the kernel body too; without the
    index it refuses."""
    stack = np.random.default_rng(0).standard_normal((6, 32, 16))
    stacked = Linear(32, 16, rngs=nnx.Rngs(0))
    stacked.kernel = nnx.Param(jnp.asarray(stack.reshape(2, 3, 32, 16), jnp.float32))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 32)), jnp.float32)
    for backend in ("reference", "interpret"):
        monkeypatch.setattr(linear_module, "layer_matmuls",
                            functools.partial(layer_matmuls, backend=backend))
        for flat in (0, 4, 5):
            out = jax.jit(lambda v, l: stacked(v, l))(x, flat)
            assert _rel(out, np.asarray(x, np.float64) @ stack[flat]) < 1e-6, (backend, flat)
    with pytest.raises(ValueError, match="needs the layer index"):
        stacked(x)

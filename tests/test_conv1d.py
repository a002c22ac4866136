"""Causal conv1d (prefill + pooled update) against a float64 NumPy oracle.

The Pallas kernel bodies run in interpret mode (backend="interpret"), where
unwritten outputs are NaN (poison) and fail the finiteness check.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import causal_conv1d_prefill, causal_conv1d_update
from pallas_kernels.oracle import conv1d_prefill_oracle as oracle_prefill

F32_TOL = 1e-4
BF16_TOL = 1e-2


def _np(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _act(y, activation):
    return y / (1.0 + np.exp(-y)) if activation == "silu" else y


def rel_err(got, want):
    got = _np(got)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite output (unwritten / NaN)"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


PREFILL_CASES = [
    # lens, trailing pad, dtype, with_init, activation
    ([1], 0, "float32", True, "silu"),
    ([63], 5, "bfloat16", False, "silu"),
    ([64], 0, "float32", False, None),
    ([65], 3, "bfloat16", True, "silu"),
    ([200], 0, "float32", True, "silu"),
    ([2, 0, 1, 70, 3, 64], 5, "float32", True, "silu"),
    ([2, 0, 1, 70, 3, 64], 5, "bfloat16", False, None),
    ([0, 0, 9], 40, "float32", True, None),
]


@pytest.mark.parametrize(
    "backend,lens,pad,dtype,with_init,activation",
    [("interpret",) + c for c in PREFILL_CASES]
    + [("reference",) + PREFILL_CASES[i] for i in (0, 3, 5, 7)])
def test_conv1d_prefill(backend, lens, pad, dtype, with_init, activation):
    rng = np.random.default_rng(sum(lens) * 31 + pad + len(dtype))
    C, K = 96, 4
    N = len(lens)
    T = sum(lens) + pad
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((T, C)), dt)
    w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, dt)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = jnp.asarray(rng.standard_normal((N, K - 1, C)), dt) if with_init else None
    fn = jax.jit(lambda cu_, x_, w_: causal_conv1d_prefill(
        x_, w_, cu_seqlens=cu_, initial_state=init, activation=activation,
        backend=backend, config=dict(bt=16, bc=32)))
    y, fin = fn(jnp.asarray(cu), x, w)
    assert y.dtype == dt and y.shape == (T, C)
    assert fin.dtype == dt and fin.shape == (N, K - 1, C)
    y_ref, f_ref = oracle_prefill(_np(x), _np(w), cu, None if init is None else _np(init),
                                  activation)
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    assert rel_err(y, y_ref) < tol
    # the state is a copy of inputs: exact
    np.testing.assert_array_equal(_np(fin), f_ref)
    assert np.all(_np(y)[cu[-1]:] == 0.0)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("dtype,activation", [("float32", "silu"), ("bfloat16", None)])
def test_conv1d_update(backend, dtype, activation):
    rng = np.random.default_rng(len(dtype) + (activation is None))
    C, K, P = 96, 4, 5
    slots = np.array([4, -1, 0, 5, 2], np.int32)
    N = len(slots)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((N, C)), dt)
    w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, dt)
    pool = jnp.asarray(rng.standard_normal((P, K - 1, C)), dt)
    before = _np(pool)
    fn = jax.jit(lambda p, s, x_, w_: causal_conv1d_update(
        x_, w_, p, s, activation=activation, backend=backend,
        config=dict(update_bc=32)), donate_argnums=0)
    y, new = fn(pool, jnp.asarray(slots), x, w)
    y_ref = np.zeros((N, C))
    p_ref = before.copy()
    for n, s in enumerate(slots):
        if 0 <= s < P:
            win = np.concatenate([before[s], _np(x)[n][None]], 0)
            y_ref[n] = _act((win * _np(w).T).sum(0), activation)
            p_ref[s] = win[1:]
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    assert rel_err(y, y_ref) < tol
    assert np.all(_np(y)[[1, 3]] == 0.0)
    np.testing.assert_array_equal(_np(new), p_ref)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_conv1d_update_writes_each_state_to_its_out_slot(backend):
    """The window read from ``slots`` shifts into ``out_slots``; an out slot past the pool
    writes nothing, a padding read neither reads nor writes."""
    rng = np.random.default_rng(5)
    C, K, P = 40, 4, 5
    slots, out_slots = np.array([4, -1, 0]), np.array([1, 2, 7])
    x = jnp.asarray(rng.standard_normal((3, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, jnp.float32)
    before = rng.standard_normal((P, K - 1, C)).astype(np.float32)
    y, new = jax.jit(lambda p: causal_conv1d_update(
        x, w, p, jnp.asarray(slots, jnp.int32), out_slots=jnp.asarray(out_slots, jnp.int32),
        backend=backend, config=dict(update_bc=32)))(jnp.asarray(before))
    expected = before.copy()
    expected[1] = np.concatenate([before[4][1:], _np(x)[0][None]], 0)
    np.testing.assert_array_equal(_np(new), expected)
    for n, s in ((0, 4), (2, 0)):
        win = np.concatenate([before[s], _np(x)[n][None]], 0)
        assert rel_err(_np(y)[n], _act((win * _np(w).T).sum(0), "silu")) < F32_TOL
    assert np.all(_np(y)[1] == 0.0)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_conv1d_update_continues_prefill(backend):
    """prefill of t tokens then update of token t+1 == prefill of t+1 tokens."""
    rng = np.random.default_rng(2)
    C, K, T = 64, 4, 7
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, K)), jnp.float32)
    y_all, _ = jax.jit(lambda a, b: causal_conv1d_prefill(
        a, b, cu_seqlens=jnp.array([0, T], jnp.int32), backend="reference"))(x, w)
    _, st = jax.jit(lambda a, b: causal_conv1d_prefill(
        a, b, cu_seqlens=jnp.array([0, T - 1], jnp.int32), backend=backend))(x[:T - 1], w)
    pool = jnp.zeros((2, K - 1, C), jnp.float32).at[1].set(st[0])
    y, pool = jax.jit(lambda a, b, p: causal_conv1d_update(
        a, b, p, jnp.array([1], jnp.int32), backend=backend))(x[T - 1:], w, pool)
    assert rel_err(y[0], _np(y_all[T - 1])) < F32_TOL
    np.testing.assert_array_equal(_np(pool[1]), _np(x[T - K + 1:]))


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_prefill_snapshots_are_the_states_of_the_truncated_sequences(backend):
    rng = np.random.default_rng(29)
    lens, C, K = [7, 1, 0, 20], 8, 4
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 3
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, K)), jnp.float32)
    init = jnp.asarray(rng.standard_normal((len(lens), K - 1, C)), jnp.float32)
    ends = np.array([1, 2, 7, 8, 9, 10, 28, 0, -3, 40], np.int32)
    y, fin, snaps = causal_conv1d_prefill(x, w, cu_seqlens=jnp.asarray(cu), initial_state=init,
                                          snapshot_ends=jnp.asarray(ends), backend=backend)
    y_ref, f_ref = oracle_prefill(_np(x), _np(w), cu, _np(init), "silu")
    assert rel_err(y, y_ref) < F32_TOL and rel_err(fin, f_ref) < F32_TOL
    for s, e in enumerate(ends):
        n = int(np.searchsorted(cu[1:], e - 1, side="right"))
        if n < len(lens) and cu[n] < e <= cu[n + 1]:
            _, want = oracle_prefill(_np(x[cu[n]:e]), _np(w), [0, e - cu[n]], _np(init[n:n + 1]),
                                     "silu")
            np.testing.assert_array_equal(_np(snaps[s]), want[0])
        else:
            assert np.all(_np(snaps[s]) == 0.0), (s, e)

"""The GDN decode kernel (one token a sequence, or a verify step's tokens) against the
float64 oracle run token by token; see gdn_cases.py for the poison and tolerances."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from gdn_cases import BF16_TOL, F32_TOL, as_f64, make_inputs, rel_err, with_backends
from pallas_kernels import gdn_decode, gdn_prefill
from pallas_kernels.oracle import gdn_prefill_oracle as oracle_prefill


def oracle_decode(q, k, v, g, beta, pool, slots, scale, l2):
    N = q.shape[0]
    P = pool.shape[0]
    o = np.zeros((N,) + v.shape[1:])
    pool = np.array(pool, np.float64)
    for n in range(N):
        s = int(slots[n])
        if not 0 <= s < P:
            continue
        cu = [0, 1]
        init = pool[s][None]
        on, fn = oracle_prefill(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1],
                                beta[n:n + 1], cu, init, scale, l2)
        o[n] = on[0]
        pool[s] = fn[0]
    return o, pool


DECODE_CASES = [
    (1, "float32", "float32", True),
    (2, "bfloat16", "float32", True),
    (4, "bfloat16", "bfloat16", False),
    (2, "float32", "bfloat16", True),
]


@pytest.mark.parametrize("backend,ratio,dtype,state_dtype,l2",
                         with_backends(DECODE_CASES, [1, 2]))
def test_decode(backend, ratio, dtype, state_dtype, l2):
    """The kernel body a row a program, and (interpret) looping over rows: 7 rows in
    programs of 4, so the last program's fourth row lies past the batch."""
    rng = np.random.default_rng(ratio * 13 + len(dtype) + len(state_dtype))
    Hk, dk, dv, bv, P = 2, 16, 32, 16, 6
    Hv = Hk * ratio
    slots = np.array([3, -1, 0, 7, 5, 6, 2], np.int32)  # -1, 7 (>= P), 6 (== P): padding
    N = len(slots)
    dt = jnp.dtype(dtype)
    sdt = jnp.dtype(state_dtype)
    q, k, v, g, beta = make_inputs(rng, 1, N, Hk, Hv, dk, dv, dt, l2)
    q, k, v, g, beta = (a[0] for a in (q, k, v, g, beta))
    pool0 = rng.standard_normal((P, Hv, dk, dv)) * 0.5
    pool_before = np.asarray(jnp.asarray(jnp.asarray(pool0, sdt), jnp.float32))
    o_ref, p_ref = oracle_decode(as_f64(q), as_f64(k), as_f64(v), as_f64(g), as_f64(beta),
                                 pool_before, slots, dk ** -0.5, l2)
    tol = F32_TOL if (dtype == "float32" and state_dtype == "float32") else BF16_TOL
    # programs_per_sm: interpret mode counts one SM, so 2 Hv (dv / bv) programs a grid
    # put the 7 rows in 2 programs of 4
    per_sm = [None, 2 * Hv * (dv // bv)] if backend == "interpret" else [None]
    for pps in per_sm:
        fn = jax.jit(lambda p, s, *a: gdn_decode(
            *a, p, s, use_qk_l2norm=l2, backend=backend,
            config=dict(bv=bv, programs_per_sm=pps)), donate_argnums=0)
        o, new_pool = fn(jnp.asarray(pool0, sdt), jnp.asarray(slots), q, k, v, g, beta)
        assert o.dtype == dt and new_pool.dtype == sdt and new_pool.shape == (P, Hv, dk, dv)
        o = as_f64(o)
        assert rel_err(o, o_ref) < tol, pps
        assert np.all(o[[1, 3, 5]] == 0.0)
        new_pool = np.asarray(jnp.asarray(new_pool, jnp.float32))
        touched = [0, 2, 3, 5]
        assert rel_err(new_pool[touched], p_ref[touched]) < tol, pps
        untouched = [1, 4]
        np.testing.assert_array_equal(new_pool[untouched], pool_before[untouched])


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_decode_writes_each_state_to_its_out_slot(backend):
    """Read one row, write another (a verify step keeps the state after each token): the
    state read from ``slots`` lands in ``out_slots``; an out slot past the pool writes
    nothing but the output is still the token's; a padding read writes nothing."""
    rng = np.random.default_rng(11)
    Hk, Hv, dk, dv, P = 1, 2, 16, 16, 6
    slots = np.array([3, -1, 0, 5], np.int32)
    out_slots = np.array([1, 2, 0, 9], np.int32)
    q, k, v, g, beta = (a[0] for a in make_inputs(rng, 1, 4, Hk, Hv, dk, dv, jnp.float32,
                                                     True))
    pool0 = rng.standard_normal((P, Hv, dk, dv)) * 0.5
    o_ref, p_ref = oracle_decode(as_f64(q), as_f64(k), as_f64(v), as_f64(g), as_f64(beta), pool0, slots,
                                 dk ** -0.5, True)
    fn = jax.jit(lambda p, *a: gdn_decode(*a, p, jnp.asarray(slots),
                                          out_slots=jnp.asarray(out_slots),
                                          use_qk_l2norm=True, backend=backend),
                 donate_argnums=0)
    o, pool = fn(jnp.asarray(pool0, jnp.float32), q, k, v, g, beta)
    pool = as_f64(pool)
    assert rel_err(as_f64(o), o_ref) < F32_TOL and np.all(as_f64(o)[1] == 0.0)
    assert rel_err(pool[[1, 0]], p_ref[[3, 0]]) < F32_TOL
    np.testing.assert_array_equal(pool[[2, 3, 4, 5]], pool0[[2, 3, 4, 5]].astype(np.float32))


@pytest.mark.parametrize("backend,state_dtype", [("interpret", "float32"),
                                                  ("interpret", "bfloat16"),
                                                  ("reference", "float32")])
def test_decode_of_a_verify_step_stores_the_state_after_each_token(backend, state_dtype):
    """R tokens a sequence in one launch, up to ``lengths`` each: the outputs and the state
    after each token (in the row ``out_slots`` names) are the float64 recurrence's from
    the state read once; positions past a sequence's length and padding rows write
    nothing and output 0."""
    rng = np.random.default_rng(17)
    Hk, Hv, dk, dv, P, R = 2, 4, 16, 32, 10, 3
    slots, lengths = np.array([2, 0, -1], np.int32), np.array([2, 1, 0], np.int32)
    out_slots = np.array([[4, 5, 1], [3, 9, 8], [6, 7, 2]], np.int32)
    N = len(slots)
    q, k, v, g, beta = make_inputs(rng, N, R, Hk, Hv, dk, dv, jnp.float32, True)
    sdt = jnp.dtype(state_dtype)
    pool0 = np.asarray(jnp.asarray(jnp.asarray(rng.standard_normal((P, Hv, dk, dv)) * 0.5,
                                               sdt), jnp.float32), np.float64)
    fn = jax.jit(lambda p, *a: gdn_decode(
        *a, p, jnp.asarray(slots), out_slots=jnp.asarray(out_slots),
        lengths=jnp.asarray(lengths), use_qk_l2norm=True, backend=backend,
        config=dict(bv=16)), donate_argnums=0)
    o, pool = fn(jnp.asarray(pool0, sdt), q, k, v, g, beta)
    o, pool = as_f64(o), np.asarray(jnp.asarray(pool, jnp.float32), np.float64)
    want = pool0.copy()
    tol = F32_TOL if state_dtype == "float32" else BF16_TOL
    for n in range(2):
        state = pool0[slots[n]][None]
        for r in range(lengths[n]):
            on, state = oracle_prefill(*(as_f64(x)[n, r:r + 1] for x in (q, k, v, g, beta)),
                                       [0, 1], state, dk ** -0.5, True)
            assert rel_err(o[n, r], on[0]) < tol, (n, r)
            want[out_slots[n, r]] = state[0]
    assert np.all(o[0, 2:] == 0) and np.all(o[1, 1:] == 0) and np.all(o[2] == 0)
    written = [4, 5, 3]
    assert rel_err(pool[written], want[written]) < tol
    np.testing.assert_array_equal(pool[[0, 1, 2, 6, 7, 8, 9]], pool0[[0, 1, 2, 6, 7, 8, 9]])


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_decode_steps_match_prefill(backend):
    """Decoding T tokens one by one through a pool == prefill of the sequence."""
    rng = np.random.default_rng(3)
    Hk, Hv, dk, dv, T = 1, 2, 16, 16, 5
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, jnp.float32, True)
    pool = jnp.asarray(rng.standard_normal((3, Hv, dk, dv)), jnp.float32)
    init = pool[1:2]
    o_pre, fin = gdn_prefill(q, k, v, g, beta, initial_state=init, use_qk_l2norm=True,
                             backend="reference")
    step = jax.jit(lambda p, *a: gdn_decode(*a, p, jnp.array([1], jnp.int32),
                                            use_qk_l2norm=True, backend=backend))
    outs = []
    for t in range(T):
        o, pool = step(pool, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o[0])
    assert rel_err(jnp.stack(outs), as_f64(o_pre[0])) < F32_TOL
    assert rel_err(pool[1], as_f64(fin[0])) < F32_TOL

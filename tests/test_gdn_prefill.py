"""GDN prefill kernels (chunked, packed, snapshots) against a float64 NumPy oracle
written from the token recurrence; see gdn_cases.py for the poison and tolerances."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from gdn_cases import BF16_TOL, F32_TOL, as_f64, make_inputs, rel_err, with_backends
from pallas_kernels import gdn_prefill
from pallas_kernels.gdn import chunk_table
from pallas_kernels.oracle import gdn_prefill_oracle as oracle_prefill


# the Pallas bodies (interpret) on every case, the chunked reference on some;
# the token-by-token reference on one packed case (test_prefill_recurrent_reference)

# (B, T, ratio, dtype, with_init, l2)
SINGLE_CASES = [
    (2, 1, 1, "float32", True, False),
    (1, 63, 2, "bfloat16", False, True),
    (1, 64, 4, "float32", False, True),
    (2, 65, 1, "bfloat16", True, True),
    (1, 200, 2, "float32", True, True),
    (1, 200, 4, "bfloat16", True, False),
]


@pytest.mark.parametrize("backend,B,T,ratio,dtype,with_init,l2",
                         with_backends(SINGLE_CASES, [3, 4]))
def test_prefill_batched(backend, B, T, ratio, dtype, with_init, l2):
    rng = np.random.default_rng(zlib.crc32(repr((B, T, ratio, dtype, with_init, l2)).encode()))
    Hk, dk, dv = 2, 16, 32
    Hv = Hk * ratio
    dt = jnp.dtype(dtype)
    q, k, v, g, beta = make_inputs(rng, B, T, Hk, Hv, dk, dv, dt, l2)
    init = (jnp.asarray(rng.standard_normal((B, Hv, dk, dv)) * 0.5, jnp.float32)
            if with_init else None)
    fn = jax.jit(lambda *a: gdn_prefill(*a, initial_state=init, use_qk_l2norm=l2,
                                        backend=backend, config=dict(bv=16)))
    o, fin = fn(q, k, v, g, beta)
    assert o.dtype == dt and o.shape == (B, T, Hv, dv)
    assert fin.dtype == jnp.float32 and fin.shape == (B, Hv, dk, dv)
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    cu = np.arange(B + 1) * T
    flat = lambda a: as_f64(a).reshape((B * T,) + a.shape[2:])
    o_ref, f_ref = oracle_prefill(flat(q), flat(k), flat(v), flat(g), flat(beta), cu,
                                  None if init is None else as_f64(init), dk ** -0.5, l2)
    assert rel_err(as_f64(o).reshape(B * T, Hv, dv), o_ref) < tol
    assert rel_err(fin, f_ref) < tol


# packed batches: lens, trailing padding, ratio, dtype, with_init
PACKED_CASES = [
    ([65, 0, 1, 130, 63, 64], 9, 1, "float32", True),
    ([65, 0, 1, 130, 63, 64], 9, 2, "bfloat16", False),
    ([200, 1, 0], 30, 4, "float32", False),
    ([0, 64, 3, 0, 70], 1, 2, "bfloat16", True),
    ([0, 5, 0], 11, 1, "float32", True),
]


@pytest.mark.parametrize("backend,lens,pad,ratio,dtype,with_init",
                         with_backends(PACKED_CASES, [0, 3]))
def test_prefill_packed(backend, lens, pad, ratio, dtype, with_init):
    rng = np.random.default_rng(sum(lens) * 7 + pad + ratio)
    Hk, dk, dv = 2, 16, 32
    Hv = Hk * ratio
    N = len(lens)
    T = sum(lens) + pad
    dt = jnp.dtype(dtype)
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, dt, True)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = (jnp.asarray(rng.standard_normal((N, Hv, dk, dv)) * 0.5, jnp.float32)
            if with_init else None)
    fn = jax.jit(lambda cu_, *a: gdn_prefill(*a, initial_state=init, cu_seqlens=cu_,
                                             use_qk_l2norm=True, backend=backend,
                                             config=dict(bv=16)))
    o, fin = fn(jnp.asarray(cu), q, k, v, g, beta)
    o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]),
                                  as_f64(beta[0]), cu, None if init is None else as_f64(init),
                                  dk ** -0.5, True)
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    o = as_f64(o[0])
    assert rel_err(o, o_ref) < tol
    assert rel_err(fin, f_ref) < tol
    # padding tokens: exactly zero
    assert np.all(o[cu[-1]:] == 0.0)
    # zero-length sequences: final state == initial state (zeros without one)
    for n, L in enumerate(lens):
        if L == 0:
            want = np.zeros((Hv, dk, dv)) if init is None else as_f64(init[n])
            np.testing.assert_array_equal(as_f64(fin[n]), want)


KERNEL_CONFIGS = [(dict(bv=16), "float32"), (dict(bv=32), "bfloat16")]


@pytest.mark.parametrize("config,dtype", KERNEL_CONFIGS,
                         ids=lambda c: f"bv{c['bv']}" if isinstance(c, dict) else c)
def test_prefill_kernel_variants(config, dtype):
    """The Pallas prefill body at V tiles smaller than dv (several programs a head)."""
    rng = np.random.default_rng(len(str(config)) + len(dtype))
    lens, pad, Hk, Hv, dk, dv = [70, 0, 1, 64, 40], 5, 1, 2, 16, 32
    T = sum(lens) + pad
    dt = jnp.dtype(dtype)
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, dt, True)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = jnp.asarray(rng.standard_normal((len(lens), Hv, dk, dv)) * 0.5, jnp.float32)
    o, fin = jax.jit(lambda c, *a: gdn_prefill(*a, initial_state=init, cu_seqlens=c,
                                               use_qk_l2norm=True, backend="interpret",
                                               config=config))(jnp.asarray(cu), q, k, v, g, beta)
    o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]), as_f64(beta[0]),
                                  cu, as_f64(init), dk ** -0.5, True)
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    assert rel_err(o[0], o_ref) < tol
    assert rel_err(fin, f_ref) < tol
    assert np.all(as_f64(o[0])[cu[-1]:] == 0.0)


def test_auto_backend_is_reference_on_cpu():
    from pallas_kernels._dispatch import resolve
    if jax.default_backend() == "cpu":
        for op in ("gdn_prefill", "gdn_decode", "conv1d_prefill", "conv1d_update"):
            assert resolve(op, "auto") == "reference"
    with pytest.raises(ValueError):
        resolve("gdn_prefill", "nope")


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_prefill_traced_cu_seqlens_one_compile(backend):
    """Same static shapes, different cu_seqlens values, one jitted function."""
    rng = np.random.default_rng(5)
    Hk, Hv, dk, dv, T = 2, 4, 16, 16, 150
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, jnp.float32, True)
    init = jnp.asarray(rng.standard_normal((3, Hv, dk, dv)), jnp.float32)
    fn = jax.jit(lambda cu_, *a: gdn_prefill(*a, initial_state=init, cu_seqlens=cu_,
                                             use_qk_l2norm=True, backend=backend))
    for lens in ([70, 0, 64], [1, 128, 20], [0, 0, 149]):
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        o, fin = fn(jnp.asarray(cu), q, k, v, g, beta)
        o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]),
                                      as_f64(beta[0]), cu, as_f64(init), dk ** -0.5, True)
        assert rel_err(o[0], o_ref) < F32_TOL
        assert rel_err(fin, f_ref) < F32_TOL
    assert fn._cache_size() == 1


def test_prefill_recurrent_reference():
    """The token-by-token reference (backend="recurrent") on a packed batch."""
    rng = np.random.default_rng(21)
    lens, pad, Hk, Hv, dk, dv = [65, 0, 1, 130], 7, 1, 4, 16, 16
    T = sum(lens) + pad
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, jnp.float32, True)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = jnp.asarray(rng.standard_normal((len(lens), Hv, dk, dv)), jnp.float32)
    o, fin = jax.jit(lambda c, *a: gdn_prefill(*a, initial_state=init, cu_seqlens=c,
                                               use_qk_l2norm=True, backend="recurrent"))(
        jnp.asarray(cu), q, k, v, g, beta)
    o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]), as_f64(beta[0]),
                                  cu, as_f64(init), dk ** -0.5, True)
    assert rel_err(o[0], o_ref) < F32_TOL
    assert rel_err(fin, f_ref) < F32_TOL
    assert np.all(as_f64(o[0])[cu[-1]:] == 0.0)
    np.testing.assert_array_equal(as_f64(fin[1]), as_f64(init[1]))


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_prefill_no_final_state_and_scale(backend):
    rng = np.random.default_rng(11)
    q, k, v, g, beta = make_inputs(rng, 1, 40, 1, 2, 16, 16, jnp.float32, True)
    o, fin = jax.jit(lambda *a: gdn_prefill(*a, scale=0.3, output_final_state=False,
                                            use_qk_l2norm=True, backend=backend))(
        q, k, v, g, beta)
    assert fin is None
    o_ref, _ = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]),
                              as_f64(beta[0]), [0, 40], None, 0.3, True)
    assert rel_err(o[0], o_ref) < F32_TOL


def test_chunk_table_never_crosses_sequences():
    lens = [65, 0, 1, 130, 63, 64, 0]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T = sum(lens) + 17
    tab = jax.jit(lambda c: chunk_table(c, T))(cu)
    assert tab["c_max"] == -(-T // 64) + len(lens)
    covered = np.zeros(T, int)
    for s, st, ln in zip(np.asarray(tab["seq"]), np.asarray(tab["start"]),
                         np.asarray(tab["length"])):
        if ln == 0:
            continue
        assert ln <= 64
        assert np.asarray(cu)[s] <= st and st + ln <= np.asarray(cu)[s + 1]
        covered[st:st + ln] += 1
    assert np.all(covered[:sum(lens)] == 1) and np.all(covered[sum(lens):] == 0)


def test_prefill_inverse_correlated_keys():
    """Keys sharing one direction make A = beta K K^T large (|A| up to ~0.9, powers of
    A up to ~1e7): the doubling inverse of the GPU kernels keeps float32 accuracy there
    (a product form (I+N)(I+N^2)... loses 5e-3 on 32-row blocks, 3e3 on 64)."""
    rng = np.random.default_rng(7)
    lens, Hk, Hv, dk, dv = [64, 100], 1, 2, 32, 16
    T = sum(lens)
    k = rng.standard_normal((1, T, Hk, dk)) + 3.0 * rng.standard_normal((1, 1, Hk, dk))
    q = rng.standard_normal((1, T, Hk, dk))
    v = rng.standard_normal((1, T, Hv, dv))
    g = np.log(rng.uniform(0.9, 0.999, (1, T, Hv)))
    beta = rng.uniform(0.5, 1.0, (1, T, Hv))
    q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta))
    cu = np.array([0, 64, T], np.int32)
    o, fin = gdn_prefill(q, k, v, g, beta, cu_seqlens=jnp.asarray(cu), use_qk_l2norm=True,
                         backend="interpret", config=dict(bv=16))
    o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]), as_f64(beta[0]),
                                  cu, np.zeros((2, Hv, dk, dv)), dk ** -0.5, True)
    assert rel_err(o[0], o_ref) < F32_TOL
    assert rel_err(fin, f_ref) < F32_TOL


# snapshot ends: inside chunks, on a chunk boundary, at a sequence's end, one token in,
# in a zero-length sequence, in the padding, negative, and ends asked for twice (a
# verify row and a prefix snapshot at one position)
SNAPSHOT_LENS = [70, 5, 0, 150]


@pytest.mark.parametrize("backend", ["interpret", "reference", "recurrent"])
def test_prefill_snapshots_are_the_states_of_the_truncated_sequences(backend):
    rng = np.random.default_rng(29)
    Hk, Hv, dk, dv = 1, 2, 16, 32
    lens = SNAPSHOT_LENS
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 9
    q, k, v, g, beta = make_inputs(rng, 1, T, Hk, Hv, dk, dv, jnp.float32, True)
    init = jnp.asarray(rng.standard_normal((len(lens), Hv, dk, dv)) * 0.5, jnp.float32)
    ends = np.array([16, 64, 70, 72, 75, 76, 75 + 128, 75 + 150, 75 + 151, -1, 0, 5000,
                     72, 16, 75 + 128, 0], np.int32)
    fn = jax.jit(lambda cu_, e, *a: gdn_prefill(*a, initial_state=init, cu_seqlens=cu_,
                                                use_qk_l2norm=True, snapshot_ends=e,
                                                backend=backend, config=dict(bv=16)))
    o, fin, snaps = fn(jnp.asarray(cu), jnp.asarray(ends), q, k, v, g, beta)
    o_ref, f_ref = oracle_prefill(as_f64(q[0]), as_f64(k[0]), as_f64(v[0]), as_f64(g[0]), as_f64(beta[0]),
                                  cu, as_f64(init), dk ** -0.5, True)
    assert rel_err(o[0], o_ref) < F32_TOL  # the cuts change no output
    assert rel_err(fin, f_ref) < F32_TOL
    assert snaps.shape == (len(ends), Hv, dk, dv)
    for s, e in enumerate(ends):
        n = int(np.searchsorted(cu[1:], e - 1, side="right"))
        if n < len(lens) and cu[n] < e <= cu[n + 1]:
            _, want = oracle_prefill(as_f64(q[0, cu[n]:e]), as_f64(k[0, cu[n]:e]), as_f64(v[0, cu[n]:e]),
                                     as_f64(g[0, cu[n]:e]), as_f64(beta[0, cu[n]:e]), [0, e - cu[n]],
                                     as_f64(init[n:n + 1]), dk ** -0.5, True)
            assert rel_err(snaps[s], want[0]) < F32_TOL, (s, e)
        else:
            assert np.all(as_f64(snaps[s]) == 0.0), (s, e)


def test_snapshot_chunk_table_cuts_chunks_at_the_ends_only():
    cu = jnp.asarray(np.array([0, 70, 75, 75, 225], np.int32))
    ends = jnp.asarray(np.array([16, 64, 75, 203, -1, 300], np.int32))
    tab = jax.jit(lambda c, e: chunk_table(c, 230, 64, e))(cu, ends)
    n = int(tab["seq_nchunks"].sum())
    start, length = np.asarray(tab["start"])[:n], np.asarray(tab["length"])[:n]
    seq, emit = np.asarray(tab["seq"])[:n], np.asarray(tab["emit"])[:n]
    # chunks tile each sequence in order; cut at 16 and 203 (64, 75 are chunk or
    # sequence ends already)
    assert list(start) == [0, 16, 64, 70, 75, 139, 203]
    assert list(start + length) == [16, 64, 70, 75, 139, 203, 225]
    assert list(seq) == [0, 0, 0, 1, 3, 3, 3]
    assert list(emit) == [0, 1, -1, 2, -1, 3, -1]
    assert list(np.asarray(tab["first"])[:n]) == [1, 0, 0, 1, 1, 0, 0]
    assert list(np.asarray(tab["last"])[:n]) == [0, 0, 1, 1, 0, 0, 1]
    assert list(np.asarray(tab["seq_first_chunk"])) == [0, 3, 4, 4]
    assert list(np.asarray(tab["seq_nchunks"])) == [3, 1, 0, 3]

"""The Mosaic GPU GDN prefill (pallas_kernels/gdn/mgpu.py and its launches and tables).

Its chunk table runs anywhere (plain XLA). Its kernels need wgmma: they run natively on
an sm90 GPU, or in JAX's Mosaic GPU interpreter, which ships from jax 0.11; on the CPU
with an older jax (the CI's 0.10.2) that test is skipped, and the same kernels are
checked against the float64 oracle on the GPU by these tests marked ``gpu``, which
``python -m bench.kernels --parts check`` runs there (bench/RESULTS.md). The Triton
kernels' tests cover the same recursion (the doubling inverse, ``test_gdn_prefill.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gdn import mgpu, mgpu_tables
from pallas_kernels.oracle import gdn_prefill_oracle, rel_err
from mosaic_runner import need_runner as _need_runner

CUS = [
    [0, 65, 65, 66, 196, 259, 323, 523],   # mixed, a zero-length sequence
    [0, 64, 192],                          # on the grid
    [0, 1],                                # one token
    [0, 200, 205, 333],                    # a short sequence inside a block
]


@pytest.mark.parametrize("cu", CUS)
def test_block_table_covers_each_sequence_on_the_grid(cu):
    total = cu[-1] + 9
    tab = {k: np.asarray(v) for k, v in mgpu_tables.block_table(jnp.asarray(cu, jnp.int32), total).items()}
    n_seq = len(cu) - 1
    c_max = -(-total // 64) + n_seq
    assert tab["start"].shape == (c_max,)
    assert np.all(tab["start"] % 64 == 0)
    used = np.zeros(c_max, bool)
    for s in range(n_seq):
        first, n = tab["seq_first_chunk"][s], tab["seq_nchunks"][s]
        rows = []
        for c in range(first, first + n):
            assert 0 <= tab["lo"][c] < tab["hi"][c] <= 64
            rows += list(range(tab["start"][c] + tab["lo"][c], tab["start"][c] + tab["hi"][c]))
            used[c] = True
        assert rows == list(range(cu[s], cu[s + 1]))  # in order, no gap, no overlap
    assert np.all(tab["hi"][~used] == 0)


def test_per_block_zero_outside_rows():
    cu = jnp.asarray([0, 70, 100], jnp.int32)
    tab = mgpu_tables.block_table(cu, 100)
    x = jnp.arange(100 * 2, dtype=jnp.float32).reshape(100, 2) + 1.0
    xb = np.asarray(mgpu_tables.per_block(x, tab))  # [C, 2, 64]
    t = {k: np.asarray(v) for k, v in tab.items()}
    for c in range(xb.shape[0]):
        for r in range(64):
            inside = t["lo"][c] <= r < t["hi"][c]
            want = np.asarray(x)[t["start"][c] + r] if inside else 0.0
            np.testing.assert_array_equal(xb[c, :, r], want)


@pytest.mark.parametrize("cu", CUS + [[0, 64, 128], [0, 8192]])
def test_block_table_from_numpy_is_the_traced_table_trimmed(cu):
    """Without cu_seqlens the table is built in NumPy at trace time, with only the used
    entries: the traced table's first entries, whose rest are unused."""
    total = cu[-1]
    traced = {k: np.asarray(v) for k, v in mgpu_tables.block_table(jnp.asarray(cu, jnp.int32), total).items()}
    static = mgpu_tables.block_table(np.asarray(cu, np.int32), total)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.int32 for v in static.values())
    n = static["start"].shape[0]
    assert n == max(1, int(traced["seq_nchunks"].sum()))
    for key in ("start", "lo", "hi"):
        np.testing.assert_array_equal(static[key], traced[key][:n])
    assert np.all(traced["hi"][n:] == 0)
    for key in ("seq_first_chunk", "seq_nchunks", "cu"):
        np.testing.assert_array_equal(static[key], traced[key])


@pytest.mark.parametrize("cu", [[0, 128, 256], [0, 70, 100]])
def test_per_block_of_a_numpy_table_equals_the_gather(cu):
    """Whole blocks in order take the reshape; the values are the gather's either way."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((cu[-1], 3)), jnp.float32)
    static = mgpu_tables.block_table(np.asarray(cu, np.int32), cu[-1])
    as_jax = {k: jnp.asarray(v) for k, v in static.items()}
    np.testing.assert_array_equal(np.asarray(mgpu_tables.per_block(x, static)),
                                  np.asarray(mgpu_tables.per_block(x, as_jax)))


def _case(rng, lens, pad, Hk, Hv, dk, dv, shared, with_init):
    T = sum(lens) + pad
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((T, Hk, dk))
    k = rng.standard_normal((T, Hk, dk)) + shared * rng.standard_normal((1, Hk, dk))
    v = rng.standard_normal((T, Hv, dv))
    g = np.log(rng.uniform(0.85, 0.999, (T, Hv)))
    beta = rng.uniform(0.05, 1.0, (T, Hv))
    init = rng.standard_normal((len(lens), Hv, dk, dv)) * 0.3 if with_init else None
    return cu, q, k, v, g, beta, init


def _run(runner, cu, q, k, v, g, beta, init, v_tiles=1):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    with runner:
        o, fin = mgpu.gdn_prefill_mgpu(
            bf(q), bf(k), bf(v), jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(cu), None if init is None else jnp.asarray(init, jnp.float32),
            scale=q.shape[-1] ** -0.5, bv=64, v_tiles=v_tiles)
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    return f64(o), f64(fin)


def _oracle(cu, q, k, v, g, beta, init):
    f64 = lambda a: np.asarray(jnp.asarray(jnp.asarray(a, jnp.bfloat16), jnp.float32), np.float64)
    n, hv, dk, dv = len(cu) - 1, v.shape[1], q.shape[-1], v.shape[-1]
    return gdn_prefill_oracle(f64(q), f64(k), f64(v), g, beta, cu,
                              np.zeros((n, hv, dk, dv)) if init is None else init,
                              dk ** -0.5, True)


ENDS = [16, 32, 64, 65, 66, 100, 196, 0, 500, 65]  # two in one block, on the grid, at
# sequence ends, a one-token sequence's, two in no sequence, and one asked for twice


def test_snapshot_table_puts_each_end_in_the_block_holding_its_last_token():
    cu = jnp.asarray([0, 65, 65, 66, 196], jnp.int32)
    tab = mgpu_tables.block_table(cu, 199)
    C = tab["start"].shape[0]
    gam = jnp.arange(C * 2 * 64, dtype=jnp.float32).reshape(C, 2, 64)
    t = {k: np.asarray(v) for k, v in mgpu_tables.snapshot_table(tab, gam, jnp.asarray(ENDS)).items()}
    start, lo, hi = (np.asarray(tab[k]) for k in ("start", "lo", "hi"))
    assert t["ok"].tolist() == [True] * 7 + [False] * 2 + [True]
    seen = []
    for c in range(C):
        assert t["lo"][c] <= t["hi"][c]
        for j in range(t["lo"][c], t["hi"][c]):
            e, r = ENDS[t["row"][j]], t["r"][j]
            assert start[c] + r == e and lo[c] < r <= hi[c]
            np.testing.assert_array_equal(t["gamma"][j], np.asarray(gam)[c, :, r - 1])
            seen.append(t["row"][j])
    assert sorted(seen) == [*range(7), 9]  # each valid end once, the others nowhere
    assert t["hi"][-1] == 8


@pytest.mark.gpu
@pytest.mark.parametrize("with_init,shared,dk,v_tiles", [
    (True, 0.0, 64, 1), (False, 3.0, 64, 1), (True, 0.0, 128, 1),
    (True, 0.0, 128, 2), (False, 3.0, 128, 2)])
def test_mgpu_prefill_matches_oracle(with_init, shared, dk, v_tiles):
    """Packed sequences off the 64-row grid, a zero-length one, padding rows; keys
    sharing a direction (large A); dk = dv = 128 (two V tiles, the models' size), in
    a CTA each or both in one."""
    runner = _need_runner()
    case = _case(np.random.default_rng(3), [65, 0, 1, 130], 3, 1, 2, dk, dk, shared,
                 with_init)
    cu = case[0]
    o, fin = _run(runner, *case, v_tiles=v_tiles)
    o_ref, f_ref = _oracle(*case)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(fin))
    assert rel_err(o[:cu[-1]], o_ref[:cu[-1]]) < 1e-2
    assert rel_err(fin, f_ref) < 1e-2
    assert np.all(o[cu[-1]:] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("with_init", [True, False])
def test_mgpu_prefill_snapshots_match_oracle(with_init):
    """The states at snapshot ends (inside blocks, two in one, on the grid, at sequence
    ends) are the oracle's final states of the sequences cut there; ends in no sequence
    give zeros; o and the final states are those of the run without snapshots."""
    runner = _need_runner()
    cu, q, k, v, g, beta, init = _case(np.random.default_rng(5), [65, 0, 1, 130], 3, 1, 2,
                                       128, 128, 0.0, with_init)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(cu), None if init is None else jnp.asarray(init, jnp.float32))
    with runner:
        o0, fin0 = mgpu.gdn_prefill_mgpu(*args, scale=128 ** -0.5, bv=64)
        o, fin, snaps = mgpu.gdn_prefill_mgpu(*args, scale=128 ** -0.5, bv=64,
                                              snapshot_ends=jnp.asarray(ENDS, jnp.int32))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o0))
    np.testing.assert_array_equal(np.asarray(fin), np.asarray(fin0))
    snaps = np.asarray(snaps, np.float64)
    for i, e in enumerate(ENDS):
        n = int(np.searchsorted(cu[1:], e - 1, side="right"))
        if e == 0 or e > cu[-1]:
            assert np.all(snaps[i] == 0.0)
            continue
        part = np.asarray([cu[n], e])
        _, ref = _oracle(part, q, k, v, g, beta, None if init is None else init[n:n + 1])
        assert rel_err(snaps[i], ref[0]) < 1e-2, (i, e)


@pytest.mark.gpu
@pytest.mark.parametrize("d,v_tiles", [(64, 1), (128, 2)])
def test_mgpu_prefill_other_sequences_nan_stays_out(d, v_tiles):
    """Non-finite values in one sequence's rows and in the padding reach no other
    sequence: the blocks a sequence shares are read whole, and 0 * NaN is NaN."""
    runner = _need_runner()
    cu, q, k, v, g, beta, init = _case(np.random.default_rng(4), [70, 100, 30], 5, 1, 2,
                                       d, d, 0.0, True)
    clean = [a.copy() for a in (q, k, v)]
    for a in (q, k, v):
        a[69] = np.nan     # the first sequence's last row, in the block it shares
        a[cu[-1]:] = np.inf  # the padding rows
    o, fin = _run(runner, cu, q, k, v, g, beta, init, v_tiles=v_tiles)
    o_ref, f_ref = _oracle(cu, *clean, g, beta, init)
    rows = slice(cu[1], cu[-1])
    assert np.all(np.isfinite(o[rows])) and np.all(np.isfinite(fin[1:]))
    assert rel_err(o[rows], o_ref[rows]) < 1e-2
    assert rel_err(fin[1:], f_ref[1:]) < 1e-2
    assert np.all(o[cu[-1]:] == 0.0)


def test_both_v_tiles_a_cta_only_from_the_chain_count_and_without_snapshots():
    """The sequential launch walks both 64-wide V tiles of a head in one CTA from
    ``pair_from`` (sequence x value head) chains, dv = 128 and no snapshots; else a CTA
    per V tile."""
    assert mgpu.v_tiles_for(16, 64, 128, 64, 128, False) == 2
    assert mgpu.v_tiles_for(2, 64, 128, 64, 128, False) == 2
    assert mgpu.v_tiles_for(1, 64, 128, 64, 128, False) == 1    # 64 chains
    assert mgpu.v_tiles_for(16, 64, 128, 64, 128, True) == 1    # snapshots
    assert mgpu.v_tiles_for(16, 64, 128, 64, None, False) == 1  # never
    assert mgpu.v_tiles_for(16, 64, 64, 64, 0, False) == 1      # one V tile
    assert mgpu.v_tiles_for(16, 64, 256, 64, 0, False) == 1     # four V tiles


def test_dispatch_takes_only_what_the_kernels_can():
    """16-bit q, k, v of one dtype with dk, dv multiples of 64 and dk <= 128; else the
    Triton kernels."""
    def arr(d, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct((8, 2, d), dtype)
    assert mgpu.takes(arr(128), arr(128), arr(128), 64)
    assert mgpu.takes(arr(64), arr(64), arr(128), 64)
    assert not mgpu.takes(arr(128, jnp.float32), arr(128, jnp.float32), arr(128, jnp.float32), 64)
    assert not mgpu.takes(arr(128), arr(128), arr(128, jnp.float16), 64)
    assert not mgpu.takes(arr(32), arr(32), arr(32), 64)
    assert not mgpu.takes(arr(256), arr(256), arr(128), 64)
    assert not mgpu.takes(arr(128), arr(128), arr(128), 32)


def test_triton_keys_without_main_are_refused_where_mosaic_is_the_default(monkeypatch):
    """On sm90 a config naming Triton-only keys would otherwise be silently ignored."""
    from pallas_kernels import tuning
    from pallas_kernels.gdn import pallas_triton
    monkeypatch.setattr(tuning, "gpu_arch", lambda: "sm90")
    x = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
    gb = jnp.zeros((1, 8, 1), jnp.float32)
    with pytest.raises(ValueError, match="main='triton'"):
        pallas_triton.gdn_prefill_pallas(x, x, x, gb, gb, config=dict(bv=16))


@pytest.mark.parametrize("l2norm", [True, False])
def test_mosaic_path_only_for_keys_it_normalises(monkeypatch, l2norm):
    """The float16 inverse needs unit keys: without the op's own l2norm the Triton
    kernels run (here: traced, not run, with the Mosaic entry replaced by a marker)."""
    from pallas_kernels import tuning
    from pallas_kernels.gdn import pallas_triton

    class Taken(Exception):
        pass

    def mosaic(*a, **k):
        raise Taken

    monkeypatch.setattr(tuning, "gpu_arch", lambda: "sm90")
    monkeypatch.setattr(mgpu, "gdn_prefill_mgpu", mosaic)
    x = jax.ShapeDtypeStruct((1, 64, 1, 64), jnp.bfloat16)
    gb = jax.ShapeDtypeStruct((1, 64, 1), jnp.float32)
    f = lambda *a: pallas_triton.gdn_prefill_pallas(*a, use_qk_l2norm=l2norm)
    if l2norm:
        with pytest.raises(Taken):
            jax.eval_shape(f, x, x, x, gb, gb)
    else:
        jax.eval_shape(f, x, x, x, gb, gb)

"""The GDN prefill and decode kernels on the GPU, the part of ``python -m bench.kernels``
(its docstring says how it times) that runs them: float64-oracle checks
(``gdn_checks``), then prefill and decode timings against FLA (``prefill_bench``,
``decode_bench``) and, with --profile, their device time."""
from __future__ import annotations

import traceback

from bench import harness
from bench.harness import (RESULTS, cfg_label, check, f64, kernel_breakdown, log, row, save,
                           time_jax, time_torch, time_torch_graph)

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels import oracle
from pallas_kernels.gdn import gdn_decode, gdn_prefill
from pallas_kernels.gdn.pallas_triton import gdn_prefill_pallas
from pallas_kernels.tuning import gdn_decode_config


def _rand_gdn(key, T, Hk, Hv, dk, dv, dtype, shared=0.0):
    """Random GDN inputs. shared > 0 adds a direction common to all keys of a head:
    correlated keys make A = beta K K^T large, the case where an unstable inverse
    fails (independent 128-d keys are nearly orthogonal)."""
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (1, T, Hk, dk), jnp.float32).astype(dtype)
    k = (jax.random.normal(ks[1], (1, T, Hk, dk), jnp.float32)
         + shared * jax.random.normal(ks[5], (1, 1, Hk, dk), jnp.float32)).astype(dtype)
    v = jax.random.normal(ks[2], (1, T, Hv, dv), jnp.float32).astype(dtype)
    g = jnp.log(jax.random.uniform(ks[3], (1, T, Hv), jnp.float32, 0.85, 0.999))
    beta = jax.random.uniform(ks[4], (1, T, Hv), jnp.float32, 0.05, 1.0)
    return q, k, v, g, beta


# prefill configs checked on the GPU, and (with --variants) timed at the first shape;
# --prefill-configs replaces the list
_TRITON = dict(main="triton")
# the last: the Mosaic sequential launch with both V tiles a CTA at any chain count (the
# checks' shapes have fewer chains than the default takes it from)
PREFILL_CFGS = [None, dict(_TRITON), dict(main="mgpu"), dict(main="mgpu", pair_mgpu_from=0)]


def _snapshot_check(tag, cu, inputs, init, pcfg, o_plain, tol):
    """Prefill with snapshot ends (inside a chunk, on a chunk boundary, at a sequence's
    end, one token in, outside every sequence): each snapshot is the oracle's final
    state of the truncated sequence, and the outputs are those of the plain call."""
    q, k, v, g, beta = inputs
    ends = np.array([16, 64, 65, 66 + 64, 66 + 130 + 1, -1], np.int32)
    o, _, snaps = jax.jit(lambda c, e, *a: gdn_prefill(
        *a, initial_state=init, cu_seqlens=c, use_qk_l2norm=True, snapshot_ends=e,
        backend=harness.BACKEND, config=pcfg))(jnp.asarray(cu), jnp.asarray(ends), *inputs)
    check(tag + " snapshots: o", oracle.rel_err(f64(o), f64(o_plain)), tol)
    Hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    worst = 0.0
    for s, e in enumerate(ends):
        n = int(np.searchsorted(cu[1:], e - 1, side="right"))
        if n >= len(cu) - 1 or not cu[n] < e <= cu[n + 1]:
            worst = max(worst, float(np.abs(f64(snaps[s])).max()))  # zero
            continue
        a = slice(int(cu[n]), int(e))
        _, want = oracle.gdn_prefill_oracle(
            f64(q[0, a]), f64(k[0, a]), f64(v[0, a]), f64(g[0, a]), f64(beta[0, a]),
            [0, e - cu[n]], np.zeros((1, Hv, dk, dv)) if init is None else f64(init[n:n + 1]),
            dk ** -0.5, True)
        worst = max(worst, oracle.rel_err(f64(snaps[s]), want[0]))
    check(tag + " snapshots: states", worst, tol)




def gdn_checks(rng, key):
    """Prefill (every config of PREFILL_CFGS, with snapshots) and decode against the
    float64 oracles, in float32 and bf16."""
    lens = [65, 0, 1, 130, 63, 64, 200]
    pad = 9
    T = sum(lens) + pad
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
      for pcfg in PREFILL_CFGS:
        for Hk, Hv, dk, dv, shared in (((2, 4, 32, 32, 0.0),) if harness.TINY else (
                (2, 8, 128, 128, 0.0), (4, 4, 64, 128, 0.0), (2, 8, 128, 128, 3.0))):
            key, k1, k2 = jax.random.split(key, 3)
            q, k, v, g, beta = _rand_gdn(k1, T, Hk, Hv, dk, dv, dtype, shared)
            # the shared-key case starts from zeros (initial_state None)
            init = (None if shared
                    else jax.random.normal(k2, (len(lens), Hv, dk, dv), jnp.float32) * 0.3)
            try:
                o, fin = jax.jit(lambda c, *a: gdn_prefill(
                    *a, initial_state=init, cu_seqlens=c, use_qk_l2norm=True,
                    backend=harness.BACKEND, config=pcfg))(jnp.asarray(cu), q, k, v, g, beta)
                o_ref, f_ref = oracle.gdn_prefill_oracle(
                    f64(q[0]), f64(k[0]), f64(v[0]), f64(g[0]), f64(beta[0]), cu,
                    np.zeros((len(lens), Hv, dk, dv)) if init is None else f64(init),
                    dk ** -0.5, True)
                tag = (f"prefill {jnp.dtype(dtype).name} Hk{Hk} Hv{Hv} dk{dk}"
                       f"{' shared-key ' + str(shared) if shared else ''} {cfg_label(pcfg)}")
                check(tag + " o", oracle.rel_err(f64(o[0]), o_ref), tol)
                check(tag + " state", oracle.rel_err(f64(fin), f_ref), tol)
                check(tag + " pad==0", float(np.abs(f64(o[0, cu[-1]:])).max()), 0.0)
                _snapshot_check(tag, cu, (q, k, v, g, beta), init, pcfg, o, tol)
            except Exception as e:  # noqa: BLE001
                log("  prefill check FAILED to run:", repr(e)[:2000])
                RESULTS["errors"].append(("prefill_check", repr(e)[:4000]))
    # decode
    for sdt, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
        if harness.TINY:
            Hk, Hv, dk, dv, P = 2, 4, 32, 32, 10
            slots = np.array([3, -1, 0, 12, 9, 5], np.int32)
        else:
            # 69 rows: with a bf16 pool, 3 programs an SM on 132 SMs and Hv 8 give 2 rows
            # a program (8 x 35 programs); the last program's rows are 68 (a real slot)
            # and one past the batch. -1 and P + 5 (rows 65, 66) are padding.
            Hk, Hv, dk, dv, P = 2, 8, 128, 128, 80
            perm = rng.permutation(P)
            slots = np.concatenate([perm[:65], [-1, P + 5], perm[65:67]]).astype(np.int32)
        N = len(slots)
        key, k1, k2 = jax.random.split(key, 3)
        q, k, v, g, beta = (a[0] for a in _rand_gdn(k1, N, Hk, Hv, dk, dv, jnp.float32))
        pool = (jax.random.normal(k2, (P, Hv, dk, dv), jnp.float32) * 0.3).astype(sdt)
        before = f64(pool)
        try:
            o, newp = jax.jit(lambda p, s, *a: gdn_decode(*a, p, s, use_qk_l2norm=True,
                                                          backend=harness.BACKEND),
                              donate_argnums=0)(pool, jnp.asarray(slots), q, k, v, g, beta)
            o_ref, p_ref = oracle.gdn_decode_oracle(f64(q), f64(k), f64(v), f64(g),
                                                    f64(beta), before, slots, dk ** -0.5, True)
            tag = f"decode state {jnp.dtype(sdt).name}"
            check(tag + " o", oracle.rel_err(f64(o), o_ref), tol)
            check(tag + " pool", oracle.rel_err(f64(newp), p_ref), tol)
            untouched = [i for i in range(P) if i not in set(slots.tolist())]
            check(tag + " untouched slots", float(np.abs(f64(newp)[untouched] - before[untouched]).max()), 0.0)
        except Exception as e:  # noqa: BLE001
            log("  decode check FAILED to run:", repr(e)[:2000])
            RESULTS["errors"].append(("decode_check", repr(e)[:4000]))


def _fla():
    try:
        import torch  # noqa: F401
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        log("FLA not available:", repr(e)[:300])
        return None


def _t(x):
    import torch
    return torch.from_dlpack(x)


PREFILL_SHAPES = [
    # name, lens (None -> one sequence of T), Hk, Hv
    ("1x8192", [8192], 16, 64),
    ("1x8192", [8192], 64, 64),
    ("1x8192", [8192], 16, 32),
    ("1x8192", [8192], 32, 32),
    ("1x32768", [32768], 16, 64),
    ("1x32768", [32768], 64, 64),
    ("1x32768", [32768], 16, 32),
    ("1x32768", [32768], 32, 32),
    ("16x4096", [4096] * 16, 16, 64),
    ("16x4096", [4096] * 16, 64, 64),
    ("16x4096", [4096] * 16, 16, 32),
    ("16x4096", [4096] * 16, 32, 32),
]


def prefill_bench(quick, variants, use_fla, only=None):
    """only: the shape names to time (e.g. ["16x4096"]), so that the whole table can be
    taken in several device calls; None: every shape (--quick: two)."""
    log("== GDN prefill (bf16 q/k/v, fp32 g/beta, dk=dv=128, l2norm in kernel, final state) ==")
    fla = _fla() if use_fla else None
    shapes = PREFILL_SHAPES[:1] + PREFILL_SHAPES[2:3] if quick else PREFILL_SHAPES
    if only:
        shapes = [sh for sh in shapes if sh[0] in only]
    dk = dv = 128
    if harness.TINY:
        shapes = [("tiny", [100, 0, 30], 2, 4), ("tiny", [64, 64], 2, 2)]
        dk = dv = 32
    best_cfg = None
    for si, (name, lens, Hk, Hv) in enumerate(shapes):
        T = sum(lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        shape = f"{name} Hk{Hk} Hv{Hv}"
        q, k, v, g, beta = _rand_gdn(jax.random.key(si), T, Hk, Hv, dk, dv, jnp.bfloat16)
        cuj = jnp.asarray(cu)
        nbytes = T * (2 * Hk * dk * 2 + 2 * Hv * dv * 2 + 2 * Hv * 4) + len(lens) * Hv * dk * dv * 4
        sweep = variants and (si == 0 or quick)  # --quick --variants: both shapes
        cfgs = [None]
        if sweep:
            cfgs = PREFILL_CFGS
        elif best_cfg is not None:
            cfgs = [best_cfg]
        ours_best = None
        for cfg in cfgs:
            label = "ours pallas " + cfg_label(cfg)
            try:
                f = jax.jit(lambda c, *a, _cfg=cfg: gdn_prefill(
                    *a, cu_seqlens=c, use_qk_l2norm=True, backend=harness.BACKEND, config=_cfg))
                ms, spread = time_jax(lambda: f(cuj, q, k, v, g, beta))
                timed_row = row("prefill", shape, label, ms, T, Hv, nbytes,
                                extra=dict(spread=spread, cfg=cfg))
                if ours_best is None or ms < ours_best[0]:
                    ours_best = (ms, cfg, f, timed_row)
                if sweep:
                    fi = jax.jit(lambda c, *a, _cfg=cfg: gdn_prefill_pallas(
                        *a, cu_seqlens=c, use_qk_l2norm=True, _only_intra=True,
                        interpret=(harness.BACKEND == "interpret"), config=_cfg))
                    ms_i, _ = time_jax(lambda: fi(cuj, q, k, v, g, beta))
                    row("prefill", shape, "intra launch only " + cfg_label(cfg), ms_i)
                    if harness.PROFILE:
                        timed_row["device_ms"] = kernel_breakdown(
                            lambda: f(cuj, q, k, v, g, beta), label)
                        save()
            except Exception as e:  # noqa: BLE001
                log(f"  {label} FAILED: {repr(e)[:3000]}")
                RESULTS["errors"].append((shape + " " + label, traceback.format_exc()[-6000:]))
        if si == 0 and variants and ours_best is not None:
            best_cfg = ours_best[1]
            RESULTS["best_prefill_cfg"] = best_cfg
            log(f"  best prefill config: {best_cfg}")
        o_ours = batched_row = None
        if ours_best is not None:
            o_ours, fin_ours = ours_best[2](cuj, q, k, v, g, beta)
            if len(set(lens)) == 1:
                batched_row = _prefill_batched(shape, lens, (q, k, v, g, beta), ours_best,
                                               (o_ours, fin_ours), T, Hv, nbytes)
        if si == 0:
            try:
                fr = jax.jit(lambda c, *a: gdn_prefill(*a, cu_seqlens=c, use_qk_l2norm=True,
                                                       backend="reference"))
                o_r, f_r = fr(cuj, q, k, v, g, beta)
                if o_ours is not None:
                    check(f"{shape} ours vs JAX chunked reference o",
                          oracle.rel_err(f64(o_ours), f64(o_r)), 1e-2)
                    check(f"{shape} ours vs JAX chunked reference state",
                          oracle.rel_err(f64(fin_ours), f64(f_r)), 1e-2)
                ms, _ = time_jax(lambda: fr(cuj, q, k, v, g, beta), reps=5)
                row("prefill", shape, "JAX chunked reference (XLA)", ms, T, Hv, nbytes)
            except Exception as e:  # noqa: BLE001
                log("  reference FAILED:", repr(e)[:2000])
        if fla is not None:
            import torch
            chunk = fla[0]
            try:
                B = len(lens)
                Tl = lens[0]
                tq, tk, tv, tg, tb = (_t(a).reshape((B, Tl) + tuple(a.shape[2:]))
                                      for a in (q, k, v, g, beta))
                fcall = lambda: chunk(tq, tk, tv, tg, tb, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
                o_f, f_f = fcall()
                torch.cuda.synchronize()
                if o_ours is not None:
                    o_f64 = o_f.float().reshape(1, T, Hv, dv).cpu().numpy().astype(np.float64)
                    check(f"{shape} ours vs FLA o", oracle.rel_err(f64(o_ours), o_f64), 2e-2)
                    check(f"{shape} ours vs FLA state",
                          oracle.rel_err(f64(fin_ours), f_f.float().cpu().numpy().astype(np.float64)), 2e-2)
                graph_row = row("prefill", shape, "FLA chunk_gated_delta_rule, CUDA graph",
                                time_torch_graph(fcall), T, Hv, nbytes)
                fla_row = row("prefill", shape, "FLA chunk_gated_delta_rule", time_torch(fcall),
                              T, Hv, nbytes)
                if harness.PROFILE and sweep:
                    fla_row["device_ms"] = kernel_breakdown(
                        lambda: (fcall(), torch.cuda.synchronize()), "FLA")
                for fla_r, name in ((graph_row, "FLA in a CUDA graph"), (fla_row, "FLA")):
                    if ours_best is not None:
                        _versus(fla_r, ours_best[3], "fla_over_ours", f"{name} / ours")
                    if batched_row is not None:
                        _versus(fla_r, batched_row, "fla_over_batched",
                                f"{name} / ours batched as FLA")
                save()
                del o_f, f_f
            except Exception as e:  # noqa: BLE001
                log("  FLA FAILED:", repr(e)[:2000])
                RESULTS["errors"].append((shape + " FLA", traceback.format_exc()[-4000:]))
        del q, k, v, g, beta, o_ours
        save()


def _prefill_batched(shape, lens, inputs, ours_best, packed, T, Hv, nbytes):
    """Ours called as FLA is: [B, T] sequences of one length and no cu_seqlens. The
    chunk table is then built in NumPy at trace time (``mgpu_tables.block_table``), where the
    packed call computes it from cu_seqlens on every call, as a server has to. The
    same kernels: checked against the packed output and state, then timed (device
    time under --profile). Returns the timed row, or None."""
    B, Tl = len(lens), lens[0]
    batched = [a.reshape((B, Tl) + a.shape[2:]) for a in inputs]
    label = "ours, batched as FLA (no cu_seqlens)"
    try:
        f = jax.jit(lambda *a, _cfg=ours_best[1]: gdn_prefill(
            *a, use_qk_l2norm=True, backend=harness.BACKEND, config=_cfg))
        o, fin = f(*batched)
        ok = [check(f"{shape} {label} vs packed o",
                    oracle.rel_err(f64(o.reshape(packed[0].shape)), f64(packed[0])), 1e-2),
              check(f"{shape} {label} vs packed state",
                    oracle.rel_err(f64(fin), f64(packed[1])), 1e-2)]
        if not all(ok):
            return None
        ms, spread = time_jax(lambda: f(*batched))
        timed = row("prefill", shape, label, ms, T, Hv, nbytes, extra=dict(spread=spread))
        if harness.PROFILE:
            timed["device_ms"] = kernel_breakdown(lambda: f(*batched), label)
        return timed
    except Exception as e:  # noqa: BLE001
        log(f"  {label} FAILED: {repr(e)[:2000]}")
        RESULTS["errors"].append((shape + " " + label, traceback.format_exc()[-4000:]))
        return None


def _versus(fla, ours, key, label):
    """FLA's row over one of ours, in wall time and, where both rows have it, in device
    time: logged, and kept on FLA's row as ``key`` and ``key + "_device"``."""
    fla[key] = fla["ms"] / ours["ms"]
    log(f"  => {label} = {fla[key]:.2f}x")
    if "device_ms" in fla and "device_ms" in ours:
        fla[key + "_device"] = fla["device_ms"] / ours["device_ms"]
        log(f"  => in device time: {label} = {fla[key + '_device']:.2f}x")


DECODE_SHAPES = [(256, 64), (64, 64), (256, 32), (1024, 32)]


# decode configs (overrides of the state width's tuning entry) that --decode-configs
# times on every shape and state width, each with its device time under --profile; None:
# the default alone (--variants: a bv x warps sweep at the first shape)
DECODE_CFGS = None


def decode_bench(quick, variants, use_fla):
    log("== GDN decode (one token per sequence, Hk=16, dk=dv=128, state pool in place) ==")
    fla = _fla() if use_fla else None
    dk = dv = 128
    Hk = 16
    shapes = DECODE_SHAPES[1:2] if quick else DECODE_SHAPES
    best_dec = {}
    if harness.TINY:
        Hk, dk, dv, shapes = 2, 32, 32, [(4, 4), (8, 2)]
    for si, (N, Hv) in enumerate(shapes):
        key = jax.random.key(100 + si)
        q, k, v, g, beta = (a[0] for a in _rand_gdn(key, N, Hk, Hv, dk, dv, jnp.bfloat16))
        slots = jnp.asarray(np.random.default_rng(si).permutation(N).astype(np.int32))
        for sdt in (jnp.float32, jnp.bfloat16):
            sb = jnp.dtype(sdt).itemsize
            nbytes = 2 * N * Hv * dk * dv * sb + N * (2 * Hk * dk + 2 * Hv * dv) * 2 + N * Hv * 8
            shape = f"N{N} Hv{Hv} state {jnp.dtype(sdt).name}"
            cfgs = [None] if DECODE_CFGS is None else DECODE_CFGS
            if variants and si == 0 and DECODE_CFGS is None:
                # bv 8 is the slowest at every warp count (bench/RESULTS.md, "GDN
                # kernels": decode), so the sweep leaves it out; the state width's
                # default is the None entry
                default = gdn_decode_config(dv, sdt)
                cfgs = [None] + [dict(bv=b, warps=w) for b in (16, 32, 64, 128)
                                 for w in (2, 4, 8) if (b, w) != (default["bv"], default["warps"])]
            if best_dec.get(sdt) is not None:
                cfgs = [best_dec[sdt]]
            pool0 = (jax.random.normal(key, (N, Hv, dk, dv), jnp.float32) * 0.1).astype(sdt)
            ref = gdn_decode(q, k, v, g, beta, pool0, slots, use_qk_l2norm=True,
                             backend="reference")
            results = []
            for cfg in cfgs:
                label = "ours pallas " + cfg_label(cfg)
                try:
                    f = jax.jit(lambda p, *a, _cfg=cfg: gdn_decode(*a, p, slots, use_qk_l2norm=True,
                                                                   backend=harness.BACKEND, config=_cfg),
                                donate_argnums=0)
                    # each config checked against the reference before it is timed
                    o, p = f(pool0 + 0, q, k, v, g, beta)
                    tol = 1e-4 if sdt == jnp.float32 else 1e-2
                    ok_o = check(f"{shape} {label} o", oracle.rel_err(f64(o), f64(ref[0])), tol)
                    ok_p = check(f"{shape} {label} pool", oracle.rel_err(f64(p), f64(ref[1])), tol)
                    if not (ok_o and ok_p):
                        continue
                    pool = [pool0 + 0]

                    def call():
                        o, pool[0] = f(pool[0], q, k, v, g, beta)
                        return o
                    ms, spread = time_jax(call)
                    row("decode", shape, label, ms, nbytes=nbytes, extra=dict(spread=spread, cfg=cfg))
                    results.append((ms, cfg))
                    if harness.PROFILE and (cfg is None or DECODE_CFGS is not None):
                        _decode_device(shape, label, call, pool)
                except Exception as e:  # noqa: BLE001
                    log(f"  {label} FAILED: {repr(e)[:3000]}")
                    RESULTS["errors"].append((shape + " " + label, traceback.format_exc()[-6000:]))
            if variants and si == 0 and results:
                best_dec[sdt] = min(results, key=lambda t: t[0])[1] or {}
                RESULTS.setdefault("best_decode_cfg", {})[jnp.dtype(sdt).name] = best_dec[sdt]
                log(f"  best decode config {jnp.dtype(sdt).name}: {best_dec[sdt]}")
            try:
                pool = [pool0 + 0]
                fr = jax.jit(lambda p, *a: gdn_decode(*a, p, slots, use_qk_l2norm=True,
                                                      backend="reference"), donate_argnums=0)

                def callr():
                    o, pool[0] = fr(pool[0], q, k, v, g, beta)
                    return o
                ms, _ = time_jax(callr, reps=10)
                row("decode", shape, "JAX reference (XLA)", ms, nbytes=nbytes)
            except Exception as e:  # noqa: BLE001
                log("  decode reference FAILED:", repr(e)[:1000])
            if fla is not None and sdt == jnp.float32:
                try:
                    import torch
                    rec = fla[1]
                    tq, tk, tv, tg, tb = (_t(a)[:, None] for a in (q, k, v, g, beta))
                    st = torch.randn(N, Hv, dk, dv, device="cuda", dtype=torch.float32) * 0.1
                    fcall = lambda: rec(tq, tk, tv, g=tg, beta=tb, initial_state=st,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
                    # correctness: same state through ours
                    o_f, s_f = fcall()
                    pool_j = jnp.asarray(st.cpu().numpy())
                    o_o, p_o = gdn_decode(q, k, v, g, beta, pool_j, jnp.arange(N, dtype=jnp.int32),
                                          use_qk_l2norm=True, backend=harness.BACKEND,
                                          config=best_dec.get(sdt) or None)
                    check(f"decode N{N} Hv{Hv} ours vs FLA o",
                          oracle.rel_err(f64(o_o), o_f[:, 0].float().cpu().numpy()), 2e-2)
                    check(f"decode N{N} Hv{Hv} ours vs FLA state",
                          oracle.rel_err(f64(p_o), s_f.float().cpu().numpy()), 1e-3)
                    ms_f = time_torch(fcall)
                    row("decode", shape, "FLA fused_recurrent (out of place)", ms_f, nbytes=nbytes)
                except Exception as e:  # noqa: BLE001
                    log("  FLA decode FAILED:", repr(e)[:2000])
                    RESULTS["errors"].append((shape + " FLA", traceback.format_exc()[-4000:]))
        save()


def _decode_device(shape, label, call, pool):
    """Device time of one decode call against a copy of its state pool (read and
    write the same bytes, ``pool * 1`` into a new buffer) in the same process: a
    ~0.1 ms kernel's wall-clock time carries the host's dispatch, which the copy
    ceiling's 1 ms calls do not (bench/RESULTS.md, decode run 4)."""
    ours = kernel_breakdown(call, label)
    cp = jax.jit(lambda p: p * 1)
    copy = kernel_breakdown(lambda: cp(pool[0]), "pool-sized copy")  # call() renews pool[0]
    if not ours:
        return  # no device plane in the trace (CPU)
    r = RESULTS["rows"][-1]
    r["device_ms"], r["copy_device_ms"] = ours, copy
    r["state_over_copy_device"] = copy / ours
    log(f"  {shape} {label}: device {ours:.4f} ms, pool-sized copy {copy:.4f} ms: "
        f"state traffic at {copy / ours * 100:.0f} % of the copy's bandwidth")
    save()

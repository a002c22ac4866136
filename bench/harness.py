"""What every kernel benchmark here shares (``bench.kernels``, ``bench.attention_kernels``):
the run's settings, its results (printed as they come and written as JSON to --out),
the ceilings measured in the same run, timing (JAX, torch, per-kernel device time) and
correctness checks."""
from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# FLOPs that ``row(tokens=, heads=)`` counts a token and head: the GDN prefill's
FLOP_PER_TOKEN_HEAD = 180e3
RESULTS: dict = {"rows": [], "checks": [], "errors": []}
# the run's settings, set by ``bench.kernels.main``
OUTDIR = None
BACKEND = "pallas"  # --backend interpret: a CPU dry run
TINY = False
PROFILE = False  # --profile: device time (prefill: each swept variant; decode: default)


def log(*a):
    print(*a, flush=True)


def save():
    if OUTDIR:
        with open(os.path.join(OUTDIR, "bench.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def block(x):
    jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_jax(call, reps=15, min_sample_s=20e-3):
    """call() dispatches one run and returns its outputs. A sample of n calls lasts
    >= 20 ms so the host's dispatch and the final sync, which the device waits
    through, add under a few percent (with 2 ms samples they added ~0.3 ms to a 1 ms
    prefill: bench/RESULTS.md, prefill run 6)."""
    block(call())
    t0 = time.perf_counter()
    block(call())
    one = time.perf_counter() - t0
    n = max(1, min(2000, int(min_sample_s / max(one, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = call()
        block(out)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples) * 1e3, (min(samples) * 1e3, max(samples) * 1e3)


def time_torch(fn):
    """Median of do_bench's second pass: the first shapes' first passes read 1.4-2x
    slow in earlier runs (bench/RESULTS.md, run 2)."""
    import triton
    triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def time_torch_graph(fn):
    """Median of do_bench_cudagraph: fn's calls replayed from a CUDA graph, so without
    the host's Python between them. FLA's wall time under do_bench swings with the
    host (0.880 ms at 1x8192 Hk16 Hv64 in runs 8-9, 1.54 ms in run 11, device time
    0.872 in all three); the graph gives its best wall time on any host."""
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def kernel_breakdown(call, label, n=10):
    """Per-kernel device time of one call (the mean of n traced calls): tells the intra
    launch from its XLA prologue and the sequential launch."""
    from bench.profile import difference, kernel_times, last_call, table

    block(call())
    res = kernel_times(lambda: block([call() for _ in range(n)]))
    events = res["events"]
    res = difference(res, {"wall_s": 0.0, "busy_s": 0.0, "kernels": {}}, n)
    log(f"  kernels of {label}, per call:")
    log(table(res, top=12))
    log(f"  the last call's kernels in order:\n{last_call(events, n)}")
    return res["busy_s"] * 1e3


def ceilings(quick):
    n = (1 << 20) if TINY else (1 << 30)  # 1 Gi bf16 elements = 2 GiB
    a = jnp.ones((n,), jnp.bfloat16) * jnp.bfloat16(1.5)
    f = jax.jit(lambda x: x * 1)
    ms, _ = time_jax(lambda: f(a), reps=10)
    bw = 2 * 2 * n / (ms * 1e-3)
    del a
    log(f"copy bandwidth (jit x*1, 2 GiB bf16, read+write): {bw / 1e12:.2f} TB/s ({ms:.3f} ms)")
    RESULTS["copy_bw_Bps"] = bw
    try:
        import torch
        t = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        u = torch.empty_like(t)
        tms = time_torch(lambda: u.copy_(t))
        RESULTS["torch_copy_bw_Bps"] = 2 * 2 * n / (tms * 1e-3)
        log(f"copy bandwidth (torch copy_): {RESULTS['torch_copy_bw_Bps'] / 1e12:.2f} TB/s")
        del t, u
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        log("torch copy failed:", e)
    m = 256 if TINY else 8192
    x = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    ms, _ = time_jax(lambda: mm(x, y), reps=10)
    RESULTS["bf16_matmul_flops"] = 2 * m ** 3 / (ms * 1e-3)
    log(f"bf16 matmul 8192^3 (XLA): {RESULTS['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    return bw


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def check(name, err, tol):
    ok = bool(np.isfinite(err) and err <= tol)
    RESULTS["checks"].append(dict(name=name, rel_err=err, tol=tol, ok=ok))
    log(f"  check {name:58s} rel_err {err:.2e} (tol {tol:.0e}) {'ok' if ok else 'FAIL'}")
    return ok


def cfg_label(cfg):
    return json.dumps(cfg, separators=(",", ":")) if cfg else "default"


def row(kind, shape, impl, ms, tokens=None, heads=None, nbytes=None, extra=None):
    r = dict(kind=kind, shape=shape, impl=impl, ms=ms)
    if tokens and heads:
        r["ns_tok_head"] = ms * 1e6 / (tokens * heads)
        r["tflops"] = FLOP_PER_TOKEN_HEAD * tokens * heads / (ms * 1e-3) / 1e12
    if nbytes:
        r["bytes"] = nbytes
        r["GBps"] = nbytes / (ms * 1e-3) / 1e9
        if RESULTS.get("copy_bw_Bps"):
            r["frac_copy_bw"] = nbytes / (ms * 1e-3) / RESULTS["copy_bw_Bps"]
    if extra:
        r.update(extra)
    RESULTS["rows"].append(r)
    s = f"{kind:8s} {shape:28s} {impl:28s} {ms:9.4f} ms"
    if "ns_tok_head" in r:
        s += f"  {r['ns_tok_head']:6.3f} ns/tok/head  {r['tflops']:6.1f} TFLOP/s"
    if nbytes:
        s += f"  {r['GBps']:7.0f} GB/s ({r.get('frac_copy_bw', 0) * 100:4.0f}% copy)"
    log(s)
    save()
    return r


def summary():
    log("\n== summary ==")
    log(f"copy bw {RESULTS.get('copy_bw_Bps', 0) / 1e12:.2f} TB/s (jax), "
        f"{RESULTS.get('torch_copy_bw_Bps', 0) / 1e12:.2f} TB/s (torch); "
        f"bf16 matmul {RESULTS.get('bf16_matmul_flops', 0) / 1e12:.0f} TFLOP/s")
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    log(f"checks: {len(RESULTS['checks']) - len(bad)} ok, {len(bad)} failed"
        + ("".join(f"\n  FAIL {c['name']} {c['rel_err']:.2e}" for c in bad)))
    for r in RESULTS["rows"]:
        s = f"{r['kind']:7s} {r['shape']:26s} {r['impl'][:44]:44s} {r['ms']:8.4f} ms"
        if "ns_tok_head" in r:
            s += f" {r['ns_tok_head']:6.3f} ns/t/h {r['tflops']:5.0f} TF/s"
        if "GBps" in r:
            s += f" {r['GBps']:6.0f} GB/s {r.get('frac_copy_bw', 0) * 100:3.0f}%"
        if "device_ms" in r:
            s += f" (device busy {r['device_ms']:.4f} ms)"
        if "state_over_copy_device" in r:
            s += f" state/copy device {r['state_over_copy_device'] * 100:.0f}%"
        if "fla_over_ours" in r:
            s += f" FLA/ours {r['fla_over_ours']:.2f}x"
        if "fla_over_ours_device" in r:
            s += f" (device {r['fla_over_ours_device']:.2f}x)"
        log(s)
    if RESULTS["errors"]:
        log(f"{len(RESULTS['errors'])} errors (see bench.json)")

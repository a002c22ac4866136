"""The causal conv1d kernels on the GPU, the part of ``python -m bench.kernels`` that runs
them: float64-oracle checks (``conv_checks``) and timings against the reference
(``conv_bench``)."""
from __future__ import annotations

import traceback

from bench import harness
from bench.harness import RESULTS, check, f64, log, row, time_jax

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels import oracle
from pallas_kernels.conv1d import causal_conv1d_prefill, causal_conv1d_update


def conv_checks(rng):
    """Prefill (ragged sequences with an empty one, padding) and update (padding slots)
    against the float64 oracle, in float32 and bf16."""
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)):
        C, K = (64, 4) if harness.TINY else (8192 + 64, 4)
        lens = [2, 0, 1, 300, 3, 64]
        T = sum(lens) + 5
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((T, C)), dtype)
        w = jnp.asarray(rng.standard_normal((C, K)) * 0.5, dtype)
        init = jnp.asarray(rng.standard_normal((len(lens), K - 1, C)), dtype)
        try:
            y, fin = jax.jit(lambda c, a, b: causal_conv1d_prefill(
                a, b, cu_seqlens=c, initial_state=init, backend=harness.BACKEND))(jnp.asarray(cu), x, w)
            y_ref, f_ref = oracle.conv1d_prefill_oracle(f64(x), f64(w), cu, f64(init), "silu")
            tag = f"conv1d prefill {jnp.dtype(dtype).name}"
            check(tag + " y", oracle.rel_err(f64(y), y_ref), tol)
            check(tag + " state", oracle.rel_err(f64(fin), f_ref), 0.0 if dtype == jnp.float32 else 1e-7)
            P = 7
            slots = np.array([4, -1, 0, 7, 2], np.int32)
            pool = jnp.asarray(rng.standard_normal((P, K - 1, C)), dtype)
            before = f64(pool)
            xu = jnp.asarray(rng.standard_normal((len(slots), C)), dtype)
            yu, newp = jax.jit(lambda p, s, a, b: causal_conv1d_update(a, b, p, s, backend=harness.BACKEND),
                               donate_argnums=0)(pool, jnp.asarray(slots), xu, w)
            y_ref = np.zeros((len(slots), C))
            p_ref = before.copy()
            for n, s in enumerate(slots):
                if 0 <= s < P:
                    win = np.concatenate([before[s], f64(xu)[n][None]], 0)
                    y_ref[n] = oracle._act((win * f64(w).T).sum(0), "silu")
                    p_ref[s] = win[1:]
            check(f"conv1d update {jnp.dtype(dtype).name} y", oracle.rel_err(f64(yu), y_ref), tol)
            check(f"conv1d update {jnp.dtype(dtype).name} pool", oracle.rel_err(f64(newp), p_ref), 0.0)
        except Exception as e:  # noqa: BLE001
            log("  conv check FAILED to run:", repr(e)[:2000])
            RESULTS["errors"].append(("conv_check", repr(e)[:4000]))


def conv_bench(quick):
    log("== causal conv1d (K=4, silu, bf16) ==")
    C, K = (64, 4) if harness.TINY else (8192, 4)
    rng = np.random.default_rng(0)
    for lens in (([50], [5] * 3) if harness.TINY else ([8192], [512] * 16)):
        T = sum(lens)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        x = jax.random.normal(jax.random.key(1), (T, C), jnp.float32).astype(jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((C, K)), jnp.bfloat16)
        init = jax.random.normal(jax.random.key(2), (len(lens), K - 1, C), jnp.float32).astype(jnp.bfloat16)
        nbytes = 2 * T * C * 2
        shape = f"T{T} N{len(lens)} C{C}"
        for be in (harness.BACKEND, "reference"):
            try:
                f = jax.jit(lambda c, a, b, _be=be: causal_conv1d_prefill(
                    a, b, cu_seqlens=c, initial_state=init, backend=_be))
                ms, _ = time_jax(lambda: f(cu, x, w))
                row("conv", shape, f"conv1d prefill {be}", ms, nbytes=nbytes)
            except Exception as e:  # noqa: BLE001
                log(f"  conv prefill {be} FAILED: {repr(e)[:2000]}")
                RESULTS["errors"].append((shape + be, traceback.format_exc()[-4000:]))
    for N in ((4,) if harness.TINY else (256, 1024)):
        x = jax.random.normal(jax.random.key(3), (N, C), jnp.float32).astype(jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((C, K)), jnp.bfloat16)
        slots = jnp.asarray(np.random.default_rng(1).permutation(N).astype(np.int32))
        nbytes = N * C * (2 * (K - 1) * 2 + 2 * 2)
        for be in (harness.BACKEND, "reference"):
            try:
                pool = [jax.random.normal(jax.random.key(4), (N, K - 1, C), jnp.float32).astype(jnp.bfloat16)]
                f = jax.jit(lambda p, a, b, _be=be: causal_conv1d_update(a, b, p, slots, backend=_be),
                            donate_argnums=0)

                def call():
                    y, pool[0] = f(pool[0], x, w)
                    return y
                ms, _ = time_jax(call)
                row("conv", f"update N{N} C{C}", f"conv1d update {be}", ms, nbytes=nbytes)
            except Exception as e:  # noqa: BLE001
                log(f"  conv update {be} FAILED: {repr(e)[:2000]}")
                RESULTS["errors"].append((f"update{N}{be}", traceback.format_exc()[-4000:]))

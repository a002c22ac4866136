"""What the GDN kernel tests share: inputs, the error measure against a float64 oracle,
and the backends each case runs on.

Every Pallas kernel body runs in interpret mode (backend="interpret"). Interpret mode
fills unwritten outputs with NaN (the poison), and NaN never passes; state pools are
filled with random values before the call and rows that must not change are compared
bit for bit.
"""
from __future__ import annotations

import numpy as np

import jax.numpy as jnp

F32_TOL = 1e-4
BF16_TOL = 1e-2


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite output (unwritten / NaN)"
    den = np.linalg.norm(want)
    return np.linalg.norm(got - want) / max(den, 1e-30)


def make_inputs(rng, B, T, Hk, Hv, dk, dv, dtype, l2):
    q = rng.standard_normal((B, T, Hk, dk))
    k = rng.standard_normal((B, T, Hk, dk))
    if not l2:  # keep |k| ~ 1 so the delta rule stays stable
        q = q / np.sqrt(dk)
        k = k / np.sqrt(dk)
    v = rng.standard_normal((B, T, Hv, dv))
    g = -rng.uniform(0.01, 0.5, (B, T, Hv))
    beta = rng.uniform(0.05, 1.0, (B, T, Hv))
    cast = lambda a: jnp.asarray(a, dtype)
    # g and beta stay float32 (as the model produces them)
    return (cast(q), cast(k), cast(v), jnp.asarray(g, jnp.float32),
            jnp.asarray(beta, jnp.float32))


def as_f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def with_backends(cases, ref_idx):
    """Every case on the Pallas bodies (interpret); the cases at ref_idx also on
    the chunked reference (keeps the CPU suite fast)."""
    out = [("interpret",) + tuple(c) for c in cases]
    out += [("reference",) + tuple(cases[i]) for i in ref_idx]
    return out

"""The timing rule shared by the GPU benchmarks (METHOD.md): median over samples,
each sample `calls` back-to-back calls and one sync, divided by `calls`, after a warm-up."""

import time

import numpy as np


def seconds_per_call(fn, *args, calls=10, samples=7):
    import jax  # imported here so that importing this module does not start a backend

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls)
    return float(np.median(times))

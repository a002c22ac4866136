"""The timing rules shared by the GPU benchmarks (METHOD.md).

``seconds_per_call``: median over samples, each sample `calls` back-to-back calls and one
sync, divided by `calls`, after a warm-up.  ``decode_step_seconds``: an engine's decode
step, as the difference of a run of 1 + steps tokens and a run of 1 token over steps
(median of three pairs), so that prefill and start-up cancel."""

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


def run_sync(engine, prompts, max_tokens: int) -> float:
    """Seconds for `engine.generate` to give every prompt `max_tokens` greedy tokens."""
    from serving.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate(prompts, [params] * len(prompts))
    return time.perf_counter() - t0


def decode_step_seconds(run, engine, prompts, steps: int, repeats: int = 3) -> float:
    """Median over `repeats` of (run(1 + steps tokens) - run(1 token)) / steps, after one
    warm run (the first dispatch of each shape); `run(engine, prompts, max_tokens)`."""
    run(engine, prompts, 1 + steps)
    return float(np.median([(run(engine, prompts, 1 + steps) - run(engine, prompts, 1)) / steps
                            for _ in range(repeats)]))

"""Decode step time of one engine, A/B in one process: which part of the serving stack
makes a decode worker's step slower than the aggregated engine's?

    python -m bench.decode_step --preset 35B-A3B --seqs 16 64 --steps 64

A decode worker differs from the aggregated server in two ways, and this benchmark
times each alone, against the plain engine, with the same compiled programs (on an
H200 neither cost anything measurable; the profile found the step's real costs:
bench/RESULTS.md, issue 8, "Decode step: profile, then fix"):

* ``cache``: the registered cache (``serving.kv_transfer.allocate_registered_cache``:
  on GPU cudaMalloc'd memory imported through DLPack) instead of XLA's own arrays;
* ``loop``: the engine driven by ``AsyncEngine`` (its thread, command inbox, output
  delivery to asyncio streams) instead of ``Engine.generate`` on the caller's thread.

Each case runs ``seqs`` greedy requests of ``--prompt-len`` tokens twice, once for one
token and once for ``1 + steps`` tokens (``ignore_eos``); a decode step costs the
difference over ``steps`` (``bench.timing.decode_step_seconds``); beside it, the median time
the host spent dispatching a step (``DispatchTimer``). The caches are swapped under
the same engine (``Engine.swap_cache``: same shapes and dtypes, so no recompile).
First it counts the copies of a whole cache array in the compiled programs (none on CPU).
With ``--profile`` it also traces the plain engine on XLA's cache (``bench.profile``) and
prints one decode step's kernels by time, and how much of the step the device was busy;
``--profile-prefill N`` does the same for one prefill step of an N-token prompt.
"""

import argparse
import asyncio
import json
import re
import time

import jax
import numpy as np

from bench import profile
from bench.timing import decode_step_seconds, run_sync
from serving.async_engine import AsyncEngine
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets
from serving.engine.capacity import allocate_cache
from serving.kv_transfer import allocate_registered_cache
from serving.llm import default_dtype, load_model


def full_cache_copies(runner) -> dict:
    """Per compiled program and cache array, the ``copy`` instructions that produce the
    whole array: each one costs a read and a write of the pool per step (an in-place
    update the compiler did not manage). Read from the optimized HLO."""
    out = {}
    for key, program in runner._programs.items():
        text = program.as_text()
        for name in ("kv", "conv", "ssm"):
            shape = ",".join(map(str, getattr(runner.cache, name).shape))
            pattern = re.compile(r"\[" + shape + r"\](\{[^}]*\})? copy\(")
            out[f"{'decode' if key[0] else 'prefill'} {key[1]}x{key[2]} {name}"] = sum(
                bool(pattern.search(line)) for line in text.splitlines())
    return out


class DispatchTimer:
    """Seconds the host spends in ``Runner.run``, dispatching a step's programs. With async
    scheduling that is a small part of a step; close to all of it means the dispatch waits
    for the device, and the host's work between steps no longer overlaps the device's
    (a ``lax.cond`` did that: ``serving/engine/sampler.py``)."""

    def __init__(self, runner):
        self.seconds: list[float] = []
        run = runner.run

        def timed(x, is_decode):
            t = time.perf_counter()
            out = run(x, is_decode)
            self.seconds.append(time.perf_counter() - t)
            return out

        runner.run = timed

    def median_ms(self, first: int) -> float:
        """Median of the dispatches since the ``first``-th, in ms (decode steps dominate)."""
        return 1e3 * float(np.median(self.seconds[first:]))


def run_async(engine: Engine, prompts, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def main():
        front = AsyncEngine(engine)
        try:
            async def one(i, p):
                async for _ in front.generate(f"r{i}-{max_tokens}", p, params):
                    pass

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return time.perf_counter() - t0
        finally:
            front.shutdown()  # stops its thread; the engine stays usable for the next case

    return asyncio.run(main())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seqs", type=int, nargs="+", default=[4])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=9216,
                   help="sizes the caches (and so what a whole-cache copy would cost)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--profile", action="store_true",
                   help="trace one decode step's kernels per batch size (plain engine, XLA cache)")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="also trace one prefill step of an N-token prompt")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    dtype = default_dtype()
    seqs = max(a.seqs)
    tokens = max(max(a.prompt_len, 64) * seqs, a.profile_prefill)
    model = load_model(a.preset, dtype, 0)
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                          max_model_len=a.max_model_len, block_size=a.block_size,
                          num_blocks=seqs * -(-a.max_model_len // a.block_size),
                          eos_token_ids=tuple(model.config.eos_token_ids),
                          buckets=Buckets((tokens,), (seqs,), tuple(sorted(set(a.seqs)))))
    caches = {
        "xla": lambda: allocate_cache(model.config, config, dtype),
        "registered": lambda: allocate_registered_cache(
            model.config, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_slots, dtype=dtype)[0],
    }
    engine = Engine(model, caches["xla"](), config)
    copies = full_cache_copies(engine.runner)
    print("whole-cache copies per step:", {k: v for k, v in copies.items() if v} or "none")
    rng = np.random.default_rng(0)
    rows, profiles = [], {}
    dispatch = DispatchTimer(engine.runner)
    if a.profile_prefill:
        prompt = [rng.integers(3, 500, a.profile_prefill).tolist()]
        run_sync(engine, prompt, 1)  # warm
        profiles["prefill"] = profile.kernel_times(lambda: run_sync(engine, prompt, 1))
        print(f"one prefill step of {a.profile_prefill} tokens, from the trace:\n"
              f"{profile.table(profiles['prefill'])}", flush=True)
    for cache_kind in ("xla", "registered"):
        if cache_kind != "xla":
            engine.swap_cache(caches[cache_kind]())
        for loop, run in (("engine", run_sync), ("async", run_async)):
            for n in a.seqs:
                prompts = [rng.integers(3, 500, a.prompt_len).tolist() for _ in range(n)]
                first = len(dispatch.seconds)
                s = decode_step_seconds(run, engine, prompts, a.steps)
                d = dispatch.median_ms(first)
                rows.append({"cache": cache_kind, "loop": loop, "seqs": n, "step_ms": 1e3 * s,
                             "dispatch_ms": d})
                print(f"cache {cache_kind:>10}  loop {loop:>6}  seqs {n:>4}  "
                      f"decode step {1e3 * s:8.2f} ms  dispatch {d:6.2f} ms", flush=True)
                if a.profile and cache_kind == "xla" and loop == "engine":
                    step = profile.difference(
                        profile.kernel_times(lambda: run(engine, prompts, 1 + a.steps)),
                        profile.kernel_times(lambda: run(engine, prompts, 1)), a.steps)
                    profiles[n] = step
                    print(f"one decode step at {n} sequences, from the trace:\n"
                          f"{profile.table(step)}", flush=True)
    base = {r["seqs"]: r["step_ms"] for r in rows if r["cache"] == "xla" and r["loop"] == "engine"}
    print("| cache | loop | seqs | decode step ms | vs xla + engine | dispatch ms |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['loop']} | {r['seqs']} | {r['step_ms']:.2f} | "
              f"{r['step_ms'] / base[r['seqs']]:.2f}x | {r['dispatch_ms']:.2f} |")
    result = {"preset": a.preset, "device": jax.devices()[0].device_kind,
              "cache_gib": {"kv": config.num_blocks * engine.runner.cache.block_nbytes / 2**30},
              "whole_cache_copies": copies, "rows": rows, "profiles": profiles}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

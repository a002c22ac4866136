"""Decode step time of one engine, A/B in one process: which part of the serving stack
makes a decode worker's step slower than the aggregated engine's?

    python -m bench.decode_step --preset 35B-A3B --seqs 16 64 --steps 64

A decode worker differs from the aggregated server in two ways, and this benchmark
times each alone, against the plain engine, with the same compiled programs (on an
H200 neither cost anything measurable; the profile found the step's real costs:
bench/RESULTS.md, "Decode step: profile, then fix"):

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
``--quantizations none fp8`` repeats it all per weight format (``--quantization``, one
model at a time), so FP8 and bf16 steps are timed in one process; ``--cases`` picks
which of the four (cache, loop) cases run; ``--prefill-len N`` also times one prefill
step of an N-token prompt (median of three single-token requests, after a warm one).
With ``--profile`` it also traces the plain engine on XLA's cache (``bench.profile``) and
prints one decode step's kernels by time, and how much of the step the device was busy;
``--profile-prefill N`` does the same for one prefill step of an N-token prompt.
Beside each step, its floor over the ceilings measured on the device first
(``bench.roofline.step_floor`` at the run's mean context, in the model's own weight
bytes, so an FP8 model's floor is its FP8 one) and the part of that floor that is the
weights' bytes alone.
"""

import argparse
import asyncio
import gc
import json
import re
import time

import jax
import numpy as np

from bench import profile
from bench.roofline import bandwidth, floor_seconds, measure_ceilings, model_costs, step_floor
from bench.timing import decode_step_seconds, run_sync
from serving.async_engine import AsyncEngine
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets
from serving.engine.capacity import allocate_cache
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
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks (default: max_model_len for every sequence)")
    p.add_argument("--profile", action="store_true",
                   help="trace one decode step's kernels per batch size (plain engine, XLA cache)")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="also trace one prefill step of an N-token prompt")
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help='config overrides for a preset, e.g. \'{"num_hidden_layers": 20}\'')
    p.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "fp8"])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                   help="(cache, loop) cases to time")
    p.add_argument("--prefill-len", type=int, default=0, metavar="N",
                   help="also time one prefill step of an N-token prompt")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    ceilings = measure_ceilings((64 if on_cpu else 4096) << 20, 512 if on_cpu else 8192)
    results = []
    for quantization in a.quantizations:
        results.append(run_case(a, None if quantization == "none" else quantization, ceilings))
        gc.collect()  # one model's weights and caches at a time
    rows = [r for res in results for r in res["rows"]]
    if len(results) > 1:
        base = {(r["cache"], r["loop"], r["seqs"]): r["step_ms"] for r in results[0]["rows"]}
        print("| weights | cache | loop | seqs | decode step ms | vs first | floor ms (% reached) "
              "| weights' floor ms |\n|---|---|---|---|---|---|---|---|")
        for r in rows:
            first = base[r["cache"], r["loop"], r["seqs"]]
            print(f"| {r['quantization']} | {r['cache']} | {r['loop']} | {r['seqs']} | "
                  f"{r['step_ms']:.2f} | {first / r['step_ms']:.2f}x "
                  f"| {r['floor_ms']:.2f} ({100 * r['floor_ms'] / r['step_ms']:.0f} %) "
                  f"| {r['weights_floor_ms']:.2f} |")
        for res in results:
            if "prefill_ms" in res:
                print(f"prefill step of {a.prefill_len} tokens, {res['quantization']}: "
                      f"{res['prefill_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


CASES = ("xla+engine", "xla+async", "registered+engine", "registered+async")


def _registered_cache(model_config, config, dtype):
    """The cache in NIXL-registered memory (imported here: the xla cases need no NIXL)."""
    from serving.kv_transfer import allocate_registered_cache
    return allocate_registered_cache(model_config, num_blocks=config.num_blocks,
                                     block_size=config.block_size, num_slots=config.num_slots,
                                     dtype=dtype)[0]


def run_case(a, quantization, ceilings) -> dict:
    """Every case of ``a`` on one model (``quantization``: None or "fp8"), each step beside
    its floor over ``ceilings``."""
    dtype = default_dtype()
    seqs = max(a.seqs)
    tokens = max(max(a.prompt_len, 64) * seqs, a.profile_prefill, a.prefill_len)
    model = load_model(a.preset, dtype, 0, hf_overrides=a.hf_overrides,
                       quantization=quantization)
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens,
                          max_model_len=a.max_model_len, block_size=a.block_size,
                          num_blocks=a.num_blocks or seqs * -(-a.max_model_len // a.block_size),
                          eos_token_ids=tuple(model.config.eos_token_ids),
                          buckets=Buckets(tuple(sorted({tokens, a.prefill_len} - {0})), (seqs,),
                                          tuple(sorted(set(a.seqs)))))
    caches = {
        "xla": lambda: allocate_cache(model.config, config, dtype),
        "registered": lambda: _registered_cache(model.config, config, dtype),
    }
    engine = Engine(model, caches["xla"](), config)
    cache = engine.runner.cache
    costs = model_costs(model, {"block_bytes": cache.block_nbytes,
                                "slot_bytes": cache.slot_nbytes}, a.block_size)
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
    result = {"preset": a.preset, "quantization": quantization or "none",
              "device": jax.devices()[0].device_kind}
    if a.prefill_len:
        prompt = [rng.integers(3, 500, a.prefill_len).tolist()]
        run_sync(engine, prompt, 1)  # warm
        result["prefill_ms"] = 1e3 * float(np.median([run_sync(engine, prompt, 1)
                                                      for _ in range(3)]))
        print(f"{quantization or 'none'}: one prefill step of {a.prefill_len} tokens "
              f"{result['prefill_ms']:.1f} ms", flush=True)
    for cache_kind in ("xla", "registered"):
        if not any(c.startswith(cache_kind + "+") for c in a.cases):
            continue
        if cache_kind != "xla":
            engine.swap_cache(caches[cache_kind]())
        for loop, run in (("engine", run_sync), ("async", run_async)):
            if f"{cache_kind}+{loop}" not in a.cases:
                continue
            for n in a.seqs:
                prompts = [rng.integers(3, 500, a.prompt_len).tolist() for _ in range(n)]
                first = len(dispatch.seconds)
                s = decode_step_seconds(run, engine, prompts, a.steps)
                d = dispatch.median_ms(first)
                f = step_floor(costs, [(a.prompt_len + a.steps // 2, 1)] * n)
                rows.append({"quantization": quantization or "none", "cache": cache_kind,
                             "loop": loop, "seqs": n, "step_ms": 1e3 * s, "dispatch_ms": d,
                             "floor_ms": 1e3 * floor_seconds(f, ceilings),
                             "weights_floor_ms": 1e3 * f["weight_bytes"] / bandwidth(ceilings)})
                print(f"cache {cache_kind:>10}  loop {loop:>6}  seqs {n:>4}  "
                      f"decode step {1e3 * s:8.2f} ms  floor {rows[-1]['floor_ms']:8.2f} ms  "
                      f"dispatch {d:6.2f} ms", flush=True)
                if a.profile and cache_kind == "xla" and loop == "engine":
                    step = profile.difference(
                        profile.kernel_times(lambda: run(engine, prompts, 1 + a.steps)),
                        profile.kernel_times(lambda: run(engine, prompts, 1)), a.steps)
                    profiles[n] = step
                    print(f"one decode step at {n} sequences, from the trace:\n"
                          f"{profile.table(step)}", flush=True)
    base = {r["seqs"]: r["step_ms"] for r in rows}  # the first case's
    print("| cache | loop | seqs | decode step ms | vs first case | floor ms (% reached) | "
          "dispatch ms |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['loop']} | {r['seqs']} | {r['step_ms']:.2f} | "
              f"{r['step_ms'] / base[r['seqs']]:.2f}x | {r['floor_ms']:.2f} "
              f"({100 * r['floor_ms'] / r['step_ms']:.0f} %) | {r['dispatch_ms']:.2f} |")
    result.update(ceilings=ceilings,
                  cache_gib={"kv": config.num_blocks * cache.block_nbytes / 2**30},
                  whole_cache_copies=copies, rows=rows, profiles=profiles)
    return result


if __name__ == "__main__":
    main()

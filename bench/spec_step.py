"""Decode with MTP drafts against without, in one process, at known acceptance rates.

    python -m bench.spec_step --preset 35B-A3B --hf-overrides '{"num_hidden_layers": 20}' \\
        --seqs 1 8 64 --k 1 2 3 --acceptance 0.6 0.8 1.0

A step with k drafts costs nearly the same whatever it accepts: its forward pass (the
decode program, its bucket k + 1 tokens a sequence) computes the k + 1 fed tokens of
every sequence, and the draft program the head over the accepted positions plus k - 1
single-token steps. So the step is timed, and the acceptance is
counted: one engine per k (k = 0 is decoding without drafts) runs ``seqs`` greedy
requests of ``--prompt-len`` random tokens with a random head, whose drafts are nearly
all rejected, and a step costs (time of a run of 1 + steps tokens - time of a run of 1
token) / (engine steps between the two); a request keeps sum_{i=0..k} a^i tokens a step
when each draft is accepted with probability a given the ones before it (the
speculative-decoding rule). Output tokens/s per user are those tokens over the step time,
per GPU that times ``seqs``. With and without drafts the engine schedules each step
while the one before runs (async scheduling, what serving runs; with drafts the next
step moves on the device by what the one before accepted).

Beside each step, its floor over the ceilings measured on the device first
(``bench.roofline``): the target forward of k + 1 tokens a sequence at the run's mean
context (``step_floor``), plus for k > 0 the draft program's k runs of the head, each
reading its decoder layer (the experts its tokens touch) and the lm_head. ``--profile
SEQS`` traces one step of each k at those sequence counts: its kernels, and the device's
busy time against the step's wall time.
"""

import argparse
import gc
import json
import time

import jax
import numpy as np

from bench import profile
from bench.roofline import (bandwidth, floor_seconds, measure_ceilings, model_costs, role_sizes,
                            step_floor, touched)
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets
from serving.engine.capacity import allocate_cache
from serving.llm import default_dtype, load_model, load_mtp_head


def tokens_per_step(k: int, acceptance: float) -> float:
    """Expected tokens a request keeps from a step with k drafts, each accepted with
    probability `acceptance` given the ones before it accepted."""
    return sum(acceptance ** i for i in range(k + 1))


def draft_bytes(mtp, costs: dict, seqs: int) -> float:
    """Bytes one run of the MTP head reads at least for ``seqs`` sequences: its weights
    (the experts its tokens touch, as ``step_floor`` counts them) and the lm_head."""
    parts = role_sizes(mtp)
    rest = sum(b for role, (_, b) in parts.items() if role != "expert")
    return rest + parts["expert"][1] * touched(costs, seqs) + costs["head_bytes"]


def floor_ms(costs: dict, ceilings: dict, k: int, seqs: int, context: int, mtp) -> float:
    """The step's floor (module docstring), in ms."""
    target = floor_seconds(step_floor(costs, [(context, k + 1)] * seqs), ceilings)
    draft = k * draft_bytes(mtp, costs, seqs) / bandwidth(ceilings) if k else 0.0
    return 1e3 * (target + draft)


def _runs(engine: Engine, prompts, steps: int):
    """A run of 1 + steps greedy tokens and one of 1 token, each returning (seconds,
    engine steps)."""
    def run(tokens):
        p = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        first, t = engine.stats["steps"], time.perf_counter()
        engine.generate(prompts, [p] * len(prompts))
        return time.perf_counter() - t, engine.stats["steps"] - first

    return lambda: run(1 + steps), lambda: run(1)


def step_seconds(engine: Engine, prompts, steps: int, repeats: int = 3) -> float:
    """Median over `repeats` of the extra time of 1 + steps tokens over 1 token, per extra
    engine step, after one warm run."""
    long, one = _runs(engine, prompts, steps)
    long()
    samples = []
    for _ in range(repeats):
        (long_s, long_n), (short_s, short_n) = long(), one()
        samples.append((long_s - short_s) / max(long_n - short_n, 1))
    return float(np.median(samples))


def step_profile(engine: Engine, prompts, steps: int) -> dict:
    """One engine step's device kernels (``bench.profile``: traced runs of 1 + steps and of
    1 token, their difference per extra engine step); its busy time beside the wall time
    tells the device's share of the step from the host's."""
    long, one = _runs(engine, prompts, steps)
    counts = {}
    a = profile.kernel_times(lambda: counts.setdefault("long", long()))
    b = profile.kernel_times(lambda: counts.setdefault("one", one()))
    return profile.difference(a, b, max(counts["long"][1] - counts["one"][1], 1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.spec_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--hf-overrides", type=json.loads, default=None)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8, 1.0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--profile", type=int, nargs="*", default=[], metavar="SEQS",
                   help="trace one step of every k at these sequence counts and print its "
                        "kernels (bench.profile); on CPU the trace has no device time")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    ceilings = measure_ceilings((64 if on_cpu else 4096) << 20, 512 if on_cpu else 8192)
    dtype = default_dtype()
    model = load_model(a.preset, dtype, 0, hf_overrides=a.hf_overrides)
    n_max = max(a.seqs)
    max_len = a.prompt_len + (a.steps + 2) * (max(a.k) + 1) + 1
    rng = np.random.default_rng(0)
    prompts = {n: [rng.integers(3, model.config.vocab_size, a.prompt_len).tolist()
                   for _ in range(n)] for n in a.seqs}
    rows = []
    for k in [0, *a.k]:
        prefill = a.prompt_len * n_max
        config = EngineConfig(
            max_num_seqs=n_max, max_num_batched_tokens=prefill, max_model_len=max_len,
            block_size=a.block_size, num_blocks=n_max * -(-max_len // a.block_size),
            eos_token_ids=tuple(model.config.eos_token_ids), num_speculative_tokens=k,
            buckets=Buckets((prefill,), tuple(sorted(set(a.seqs))), tuple(sorted(set(a.seqs)))))
        mtp = load_mtp_head(a.preset, model.config, dtype, 0) if k else None
        cache = allocate_cache(model.config, config, dtype)
        engine = Engine(model, cache, config, mtp=mtp)
        costs = model_costs(model, {"block_bytes": cache.block_nbytes,
                                    "slot_bytes": cache.slot_nbytes}, a.block_size)
        for n in a.seqs:
            s = step_seconds(engine, prompts[n], a.steps)
            floor = floor_ms(costs, ceilings, k, n, a.prompt_len + a.steps // 2, mtp)
            rows.append({"k": k, "seqs": n, "step_ms": 1e3 * s, "floor_ms": floor,
                         "serving_compiles": engine.compiles.serving_compiles})
            if n in a.profile:
                step = step_profile(engine, prompts[n], a.steps)
                rows[-1]["profile"] = {key: step[key] for key in ("wall_s", "busy_s", "kernels")}
                print(f"one step, k {k}, {n} sequences, from the trace:\n"
                      f"{profile.table(step)}", flush=True)
            print(f"k {k}  seqs {n:>4}  step {1e3 * s:8.2f} ms  floor {floor:8.2f} ms",
                  flush=True)
        del engine
        gc.collect()
    base = {r["seqs"]: r["step_ms"] for r in rows if r["k"] == 0}
    print("| k | seqs | step ms | step vs k=0 | floor ms (step / floor) | " + " | ".join(
        f"tok/s/user at a={x} (vs k=0)" for x in a.acceptance) + " |")
    print("|---|---|---|---|---|" + "---|" * len(a.acceptance))
    for r in rows:
        per_user = {x: tokens_per_step(r["k"], x) / r["step_ms"] * 1e3 for x in a.acceptance}
        r["tok_s_per_user"] = per_user
        r["tok_s_per_gpu"] = {x: v * r["seqs"] for x, v in per_user.items()}
        plain = 1e3 / base[r["seqs"]]
        print(f"| {r['k']} | {r['seqs']} | {r['step_ms']:.2f} | "
              f"{r['step_ms'] / base[r['seqs']]:.2f}x | "
              f"{r['floor_ms']:.2f} ({r['step_ms'] / r['floor_ms']:.1f}x) | " + " | ".join(
                  f"{per_user[x]:.1f} ({per_user[x] / plain:.2f}x)" for x in a.acceptance) + " |")
    result = {"preset": a.preset, "hf_overrides": a.hf_overrides,
              "device": jax.devices()[0].device_kind, "ceilings": ceilings, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

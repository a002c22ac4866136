"""Offline throughput of the aggregated engine, with random weights, beside its roofline.

    python -m bench.offline --preset tiny --num-prompts 64 --input-len 128 --output-len 64

All requests are queued at once (vLLM's `bench throughput` setting) with
`ignore_eos`, so every request produces exactly its output length. Reports
total and output tokens/s, TTFT and TPOT (mean, median, p99, in ms), the
share of the busy span during which the device waited for the host (overall,
and over decode steps of at least 64 sequences, where the target is < 5 %),
and the start-up compile time; `--json` writes the same as a file.

Roofline: before the model is created, the run measures its own ceilings on
the device (copy and read bandwidth, bf16 matmul rate; random data, median of
several samples; the higher of the two bandwidths is the roofline's). Each
step the engine dispatched is recorded as its (start, tokens) per sequence;
its floor is max(FLOPs / matmul rate,
bytes / bandwidth) with bytes = the weights it must read (dense weights and
the LM head always, each expert with the probability that one of the step's
tokens routes to it) + KV read and written + GDN/conv state read and written,
and FLOPs = 2 x active parameters per token + the LM head per sequence +
causal attention + the GDN recurrence (11 dk dv per token and value head, the
chunked form's count). The sum of the floors is the run's ideal device time;
each step's measured device time comes from the idle timer's completion stamps.

`--check` then (after the timed run) generates greedily for two prompts and
teacher-forces the model's plain forward over prompt + output: every engine
token must rank among the forward's top CHECK_TOP_RANK (near-ties of random
weights' flat logits may swap in bf16).
"""

import argparse
import json
import logging
import time

import numpy as np

from bench.roofline import bandwidth, measure_ceilings, model_costs, step_floor
from serving import LLM, SamplingParams
from serving.engine.buckets import Buckets

CHECK_TOP_RANK = 5  # --check: the engine's greedy token must be among the forward's top 5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset (random weights) or checkpoint dir")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workloads", default=None,
                   help="several timed runs on one engine: PROMPTS:IN:OUT,... "
                        "(overrides the three above)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="weights and activations (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None, help="default: input+output lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="default: sized from device memory")
    p.add_argument("--memory-utilization", type=float, default=0.85)
    p.add_argument("--no-async", action="store_true", help="process each step before the next")
    for name in ("prefill-token-buckets", "prefill-seq-buckets", "decode-seq-buckets"):
        p.add_argument(f"--{name}", type=lambda v: tuple(int(x) for x in v.split(",")),
                       default=None, help="comma-separated sizes (default: engine's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceiling-mib", type=int, default=None,
                   help="array size for the bandwidth ceilings (default 4096 on GPU, 64 on CPU)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="square bf16 matmul for the rate ceiling (default 8192 on GPU, 512 on CPU)")
    p.add_argument("--check", action="store_true",
                   help="after the timed run, check greedy tokens against the plain forward")
    p.add_argument("--check-len", type=int, default=200, help="prompt length of the check")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def lengths(rng, n, mean, ratio):
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, n)


def stats_ms(xs):
    xs = np.asarray(xs, float) * 1e3
    if xs.size == 0:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"mean": float(xs.mean()), "median": float(np.median(xs)),
            "p99": float(np.percentile(xs, 99))}


def roofline(costs: dict, ceilings: dict, records, timeline) -> dict:
    """Per-phase floor against measured device time, and the host-idle share
    (device waiting for a dispatch after finishing the previous step) overall and
    over decode steps of >= 64 sequences. records[i] is the i-th dispatched step's
    (is_decode, [(start, tokens)]); timeline[i] its (seq, dispatch, done)."""
    bw, rate = bandwidth(ceilings), ceilings["matmul_flops_per_s"]
    phases = {k: dict(steps=0, tokens=0, busy_s=0.0, floor_s=0.0, memory_bound=0)
              for k in ("prefill", "decode", "all")}
    idle = big_idle = big_span = 0.0
    prev_done = None
    for (is_decode, seqs), (_, dispatch, done) in zip(records, timeline):
        f = step_floor(costs, seqs)
        t_mem, t_fl = f["bytes"] / bw, f["flops"] / rate
        busy = done - (dispatch if prev_done is None else max(dispatch, prev_done))
        for k in ("decode" if is_decode else "prefill", "all"):
            p = phases[k]
            p["steps"] += 1
            p["tokens"] += f["tokens"]
            p["busy_s"] += busy
            p["floor_s"] += max(t_mem, t_fl)
            p["memory_bound"] += t_mem >= t_fl
        if prev_done is not None:
            gap = max(0.0, dispatch - prev_done)
            idle += gap
            if is_decode and f["seqs"] >= 64:
                big_idle += gap
                big_span += done - prev_done
        prev_done = done
    span = timeline[-1][2] - timeline[0][1] if timeline else 0.0
    return {"bandwidth_bytes_per_s": bw, "matmul_flops_per_s": rate, "phases": phases,
            "host_idle_share": idle / span if span > 0 else 0.0,
            "host_idle_share_decode_ge64": big_idle / big_span if big_span else None,
            "decode_ge64_span_s": big_span}


def record_schedules(engine) -> list:
    """Wrap the engine's scheduler so every non-empty step is kept as
    (is_decode, [(start, tokens)]): the engine itself keeps only counts, and the
    roofline needs each step's shape. One append per step on the host."""
    records = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        if out.seqs:
            records.append((out.is_decode, [(s.start, s.num_tokens) for s in out.seqs]))
        return out

    engine.scheduler.schedule = recording
    return records


# ---- correctness ----------------------------------------------------------

def check_greedy(llm, rng, prompt_len: int, new_tokens: int = 8) -> dict:
    """Two prompts of one length through the engine (greedy), then the plain
    forward over prompt + output. Random weights give near-flat logits over a
    large vocabulary, whose top few lie within a few percent of each other, so
    bf16 batching noise may swap neighbours: the engine's token must rank among
    the forward's top CHECK_TOP_RANK at every position (a wrong slot, block or
    position picks a token from anywhere in the vocabulary). The gap to the top
    logit is also reported in units of the row's standard deviation."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    vocab = llm.model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab, prompt_len)] for _ in range(2)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                ignore_eos=True))
    ids = jnp.asarray([p + o.token_ids for p, o in zip(prompts, outs)], jnp.int32)
    graphdef, state = nnx.split(llm.model)  # a pure function: only logits come back
    logits = np.asarray(jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))(state, ids[:, :-1]))
    rows = logits[:, prompt_len - 1:]  # [2, new_tokens, vocab]: predicts each output
    toks = np.asarray([o.token_ids for o in outs])
    chosen = np.take_along_axis(rows, toks[..., None], -1)
    rank = (rows > chosen).sum(-1)  # 0: the forward's argmax
    gap = (rows.max(-1) - chosen[..., 0]) / rows.std(-1)
    return {"ok": bool(rank.max() < CHECK_TOP_RANK), "argmax_agreement": float((rank == 0).mean()),
            "max_rank": int(rank.max()), "max_gap_sigma": float(gap.max()),
            "max_relative_gap": float(((rows.max(-1) - chosen[..., 0])
                                       / np.abs(rows).max(-1)).max())}


# ---- main -----------------------------------------------------------------

def workloads(a) -> list[tuple[int, int, int]]:
    """(prompts, input length, output length) of each timed run."""
    if not a.workloads:
        return [(a.num_prompts, a.input_len, a.output_len)]
    return [tuple(int(v) for v in w.split(":")) for w in a.workloads.split(",")]


COUNTERS = ("steps", "decode_steps", "prefill_steps", "scheduled_tokens", "padded_tokens",
            "num_preemptions", "serving_compiles")


def run_workload(llm, records: list, rng, a, num_prompts: int, input_len: int,
                 output_len: int, ceilings: dict) -> dict:
    """One timed `generate` of all prompts queued at once; its figures and roofline
    come from this run's steps only, so several runs can share one engine."""
    engine = llm.engine
    in_lens = lengths(rng, num_prompts, input_len, a.range_ratio)
    out_lens = lengths(rng, num_prompts, output_len, a.range_ratio)
    vocab = llm.model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in in_lens]
    params = [SamplingParams(max_tokens=int(n), temperature=a.temperature, ignore_eos=True,
                             seed=a.seed + i) for i, n in enumerate(out_lens)]
    before = llm.metrics()
    first_record, first_seq = len(records), engine.fence.dispatched
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    last_seq = engine.fence.dispatched
    deadline = time.perf_counter() + 10  # the idle timer's thread stamps the last completions
    while True:
        timeline = [s for s in engine.idle_timer.timeline() if first_seq < s[0] <= last_seq]
        if len(timeline) == last_seq - first_seq or time.perf_counter() > deadline:
            break
        time.sleep(0.01)
    m = llm.metrics()
    d = {k: m[k] - before[k] for k in COUNTERS}

    n_in, n_out = int(in_lens.sum()), sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics["first_token"] - o.metrics["arrival"] for o in outs]
    tpot = [(o.metrics["finish"] - o.metrics["first_token"]) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    costs = model_costs(llm.model, m["cache"], a.block_size)
    roof = roofline(costs, ceilings, records[first_record:], timeline)
    ideal = roof["phases"]["all"]["floor_s"]
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "elapsed_s": elapsed, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(outs) / elapsed, "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "roofline_output_throughput": n_out / ideal,
        "roofline_total_throughput": (n_in + n_out) / ideal,
        "ttft_ms": stats_ms(ttft), "tpot_ms": stats_ms(tpot),
        "host_idle_share": roof["host_idle_share"],
        "host_idle_share_decode_ge64": roof["host_idle_share_decode_ge64"],
        **d, "padding_share": 1 - d["scheduled_tokens"] / max(d["padded_tokens"], 1),
        "roofline": roof, "model_costs": costs,
    }


def main(argv=None):
    import jax

    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rng = np.random.default_rng(a.seed)
    runs = workloads(a)
    widen = 1 + a.range_ratio
    max_model_len = a.max_model_len or max(int(i * widen) + int(o * widen) + 2 for _, i, o in runs)

    on_cpu = jax.default_backend() == "cpu"
    ceilings = measure_ceilings((a.ceiling_mib or (64 if on_cpu else 4096)) << 20,
                                a.matmul_size or (512 if on_cpu else 8192))

    buckets = None
    if a.prefill_token_buckets or a.prefill_seq_buckets or a.decode_seq_buckets:
        d = Buckets.default(a.max_num_seqs, a.max_num_batched_tokens)
        buckets = Buckets(a.prefill_token_buckets or d.prefill_tokens,
                          a.prefill_seq_buckets or d.prefill_seqs,
                          a.decode_seq_buckets or d.decode_seqs)
    t0 = time.perf_counter()
    llm = LLM(a.preset, seed=a.seed, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=max_model_len,
              block_size=a.block_size, num_blocks=a.num_blocks,
              memory_utilization=a.memory_utilization, async_scheduling=not a.no_async,
              buckets=buckets, track_device_idle=True)
    startup = time.perf_counter() - t0
    records = record_schedules(llm.engine)
    m = llm.metrics()
    result = {
        "preset": a.preset, "device": str(jax.devices()[0].device_kind),
        "range_ratio": a.range_ratio, "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens, "block_size": a.block_size,
        "max_model_len": max_model_len, "async": not a.no_async, "startup_s": startup,
        "warmup_compile_s": m["warmup_seconds"], "ceilings": ceilings, "cache": m["cache"],
        "runs": [],
    }
    for w in runs:  # each run's figures are printed and saved as soon as it ends
        result["runs"].append(run_workload(llm, records, rng, a, *w, ceilings))
        _print(result, result["runs"][-1])
        _save(result, a.json)
    if a.check:
        result["check"] = check_greedy(llm, rng, min(a.check_len, max_model_len - 8))
        k = result["check"]
        print(f"{'greedy check':>24}: {'PASS' if k['ok'] else 'FAIL'} (argmax agreement "
              f"{k['argmax_agreement']:.2f}, worst rank {k['max_rank']}, largest gap "
              f"{k['max_gap_sigma']:.2f} sigma = {k['max_relative_gap']:.1e} of max |logit|)")
        _save(result, a.json)
    return result


def _save(result: dict, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _print(r: dict, w: dict) -> None:
    """The device line, then workload `w`'s figures and its roofline table."""
    c = r["ceilings"]
    print(f"\n{'device':>24}: {r['device']}  (copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"read {c['read_bytes_per_s'] / 1e9:.0f} GB/s, bf16 matmul "
          f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, measured in this run)")
    print(f"{'start-up':>24}: {r['startup_s']:.1f} s, of which compile "
          f"{r['warmup_compile_s']:.1f} s")
    print(f"\n{'workload':>24}: {w['num_prompts']} prompts x {w['input_len']} in / "
          f"{w['output_len']} out, {w['elapsed_s']:.2f} s")
    print(f"{'output tokens/s':>24}: {w['output_throughput']:.1f}  "
          f"(roofline {w['roofline_output_throughput']:.1f})")
    print(f"{'total tokens/s':>24}: {w['total_token_throughput']:.1f}  "
          f"(roofline {w['roofline_total_throughput']:.1f})")
    for k in ("ttft_ms", "tpot_ms"):
        s = w[k]
        print(f"{k:>24}: mean {s['mean']:.2f}  median {s['median']:.2f}  p99 {s['p99']:.2f}")
    ge64 = w["host_idle_share_decode_ge64"]
    print(f"{'host-idle share':>24}: {100 * w['host_idle_share']:.1f} % overall, "
          + ("n/a" if ge64 is None else f"{100 * ge64:.1f} %")
          + f" over decode steps of >= 64 seqs ({w['steps']} steps: {w['decode_steps']} "
          f"decode, {w['prefill_steps']} prefill/mixed; padding {100 * w['padding_share']:.0f} %)")
    print(f"{'preemptions, compiles':>24}: {w['num_preemptions']}, "
          f"{w['serving_compiles']} after warm-up")
    print("\n| phase | steps | tokens | device busy s | floor s | memory-bound steps | floor/busy |")
    print("|---|---|---|---|---|---|---|")
    for name, p in w["roofline"]["phases"].items():
        eff = p["floor_s"] / p["busy_s"] if p["busy_s"] > 0 else 0.0
        print(f"| {name} | {p['steps']} | {p['tokens']} | {p['busy_s']:.3f} "
              f"| {p['floor_s']:.3f} | {p['memory_bound']} | {100 * eff:.0f} % |")


if __name__ == "__main__":
    main()

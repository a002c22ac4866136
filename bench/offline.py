"""Offline throughput of the aggregated engine, with random weights.

    python -m bench.offline --preset tiny --num-prompts 64 --input-len 128 --output-len 64

All requests are queued at once (vLLM's `bench throughput` setting) with
`ignore_eos`, so every request produces exactly its output length. Reports
total and output tokens/s, TTFT and TPOT (mean, median, p99, in ms), the
share of the busy span during which the device waited for the host, and the
start-up compile time; `--json` writes the same as a file.
"""

import argparse
import json
import logging
import time

import numpy as np

from serving import LLM, SamplingParams
from serving.engine.buckets import Buckets


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset (random weights) or checkpoint dir")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
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


def main(argv=None):
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rng = np.random.default_rng(a.seed)
    in_lens = lengths(rng, a.num_prompts, a.input_len, a.range_ratio)
    out_lens = lengths(rng, a.num_prompts, a.output_len, a.range_ratio)
    max_model_len = a.max_model_len or int(in_lens.max() + out_lens.max())

    buckets = None
    if a.prefill_token_buckets or a.prefill_seq_buckets or a.decode_seq_buckets:
        d = Buckets.default(a.max_num_seqs, a.max_num_batched_tokens)
        buckets = Buckets(a.prefill_token_buckets or d.prefill_tokens,
                          a.prefill_seq_buckets or d.prefill_seqs,
                          a.decode_seq_buckets or d.decode_seqs)
    t0 = time.perf_counter()
    llm = LLM(a.preset, seed=a.seed, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=max_model_len,
              block_size=a.block_size, num_blocks=a.num_blocks,
              memory_utilization=a.memory_utilization, async_scheduling=not a.no_async,
              buckets=buckets, track_device_idle=True)
    startup = time.perf_counter() - t0
    vocab = llm.model.config.vocab_size
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in in_lens]
    params = [SamplingParams(max_tokens=int(n), temperature=a.temperature, ignore_eos=True,
                             seed=a.seed + i) for i, n in enumerate(out_lens)]

    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0

    n_in, n_out = int(in_lens.sum()), sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics["first_token"] - o.metrics["arrival"] for o in outs]
    tpot = [(o.metrics["finish"] - o.metrics["first_token"]) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    m = llm.metrics()
    result = {
        "preset": a.preset, "num_prompts": a.num_prompts, "input_len": a.input_len,
        "output_len": a.output_len, "range_ratio": a.range_ratio, "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens, "async": not a.no_async,
        "elapsed_s": elapsed, "startup_s": startup, "warmup_compile_s": m["warmup_seconds"],
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(outs) / elapsed, "output_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "ttft_ms": stats_ms(ttft), "tpot_ms": stats_ms(tpot),
        "host_idle_share": m["host_idle_share"], "device_idle_s": m["device_idle_s"],
        "steps": m["steps"], "decode_steps": m["decode_steps"], "prefill_steps": m["prefill_steps"],
        "padding_share": 1 - m["scheduled_tokens"] / max(m["padded_tokens"], 1),
        "num_preemptions": m["num_preemptions"], "serving_compiles": m["serving_compiles"],
        "cache": m["cache"],
    }
    print(f"\n{'requests':>24}: {len(outs)} in {elapsed:.2f} s (start-up {startup:.1f} s, "
          f"of which compile {m['warmup_seconds']:.1f} s)")
    print(f"{'output tokens/s':>24}: {result['output_throughput']:.1f}")
    print(f"{'total tokens/s':>24}: {result['total_token_throughput']:.1f}")
    for k in ("ttft_ms", "tpot_ms"):
        s = result[k]
        print(f"{k:>24}: mean {s['mean']:.2f}  median {s['median']:.2f}  p99 {s['p99']:.2f}")
    print(f"{'host-idle share':>24}: {100 * result['host_idle_share']:.1f} % "
          f"({result['steps']} steps: {result['decode_steps']} decode, "
          f"{result['prefill_steps']} prefill/mixed; padding {100 * result['padding_share']:.0f} %)")
    print(f"{'preemptions, compiles':>24}: {result['num_preemptions']}, "
          f"{result['serving_compiles']} after warm-up")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

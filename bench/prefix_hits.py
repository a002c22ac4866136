"""The prefix-cache hit rate of a burst, on the engine alone (no GPU, no servers).

    python -m bench.prefix_hits [--num-prompts 128] [--input-len 8192] [--orders 3]

Runs the engine's scheduler, block pool and prefix cache at a server's sizes over the
engine tests' fake model (tests/test_engine_fake_model.py: a stand-in whose next token
depends on every earlier token through the paged KV and the recurrent state, cheap
enough for 128 prompts of 8192 tokens on a CPU), on ``bench.load.prefix_dataset``'s
prompts: all at once in arrival order, then in ``--orders`` shuffled orders (requests
reach a prefill worker through the router, not strictly in order). Prints the hit
rate (cached prompt tokens over prompt tokens, as vllm:prefix_cache_hits_total over
queries) beside the most this load allows: every prompt but the first of each prefix
hitting all the full blocks of its prefix; and the engine step by which the median and
the 90th-percentile request had its first token (what TTFT counts in steps), under each
``--scheduling-policies`` value.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

import numpy as np  # noqa: E402
from test_engine_fake_model import FakeBatch, FakeCache, FakeModel  # noqa: E402

from bench.load import prefix_dataset  # noqa: E402
from serving.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from serving.engine.buckets import Buckets  # noqa: E402

VOCAB = 101


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--shared-prefix-len", type=int, default=7372)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=18432)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefill-seq-buckets", default="4,128")
    p.add_argument("--prefix-state-interval", type=int, default=32)
    p.add_argument("--num-prefix-snapshots", type=int, default=None,
                   help="default: --max-num-seqs, as the servers'")
    p.add_argument("--orders", type=int, default=3, help="shuffled orders after the first")
    p.add_argument("--scheduling-policies", nargs="+", default=["lpm", "fcfs"],
                   choices=["lpm", "fcfs"])
    return p


def hit_rate(args, prompts, policy: str) -> tuple[float, float, float]:
    """(hit rate, step of the median request's first token, of the 90th percentile's)."""
    cfg = EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + 16, block_size=args.block_size,
        num_blocks=args.num_blocks, num_slots=args.max_num_seqs, eos_token_ids=(0,),
        buckets=Buckets(prefill_tokens=(args.max_num_batched_tokens,),
                        prefill_seqs=tuple(int(s) for s in args.prefill_seq_buckets.split(",")),
                        decode_seqs=(args.max_num_seqs,)),
        enable_prefix_caching=True, prefix_state_interval=args.prefix_state_interval,
        num_prefix_snapshots=args.num_prefix_snapshots, scheduling_policy=policy)
    engine = Engine(FakeModel(VOCAB), FakeCache.allocate(cfg.num_blocks, cfg.block_size,
                                                         cfg.num_state_rows),
                    cfg, batch_type=FakeBatch)
    try:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        first = []  # per request, the steps run when its (only) token came out
        while engine.has_unfinished():
            first += [engine.stats["steps"]] * sum(o.finished for o in engine.step())
        m = engine.metrics()
        return (m["prefix_cache_hits"] / m["prefix_cache_queries"], float(np.median(first)),
                float(np.percentile(first, 90)))
    finally:
        engine.close()


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    data = prefix_dataset(args.num_prompts, args.input_len, 1, 0.0, "vllm", VOCAB, 1,
                          args.shared_prefix_len, args.num_prefixes)
    prompts = [p for p, _ in data]
    shared = (min(args.shared_prefix_len, args.input_len - 1) // args.block_size) * args.block_size
    best = (len(prompts) - min(args.num_prefixes, len(prompts))) * shared / (
        len(prompts) * args.input_len)
    print(f"most this load allows: {best:.2%}")
    orders = [("in arrival order", prompts)]
    for seed in range(1, args.orders + 1):
        order = list(range(len(prompts)))
        random.Random(seed).shuffle(order)
        orders.append((f"shuffled (seed {seed})", [prompts[i] for i in order]))
    for policy in args.scheduling_policies:
        for name, ps in orders:
            rate, median, p90 = hit_rate(args, ps, policy)
            print(f"{name}, {policy}: {rate:.2%} hit rate; first token by step {median:g} "
                  f"(median), {p90:g} (p90)")


if __name__ == "__main__":
    main()

"""Exact-match accuracy of served answers, aggregated against disaggregated (and sharded).

    python -m bench.accuracy                                  # CPU: tiny-math, float32 + bf16,
                                                              # aggregated, disaggregated, --tp 2
    python -m bench.accuracy --model tiny-math-moe            # + --ep 2
    python -m bench.accuracy --dtypes bfloat16 --layouts aggregated disaggregated   # a GPU
    python -m bench.accuracy --quantizations none fp8         # + FP8 weights (--quantization)
    python -m bench.accuracy --speculative-tokens 0 1 2 3 --layouts aggregated disaggregated

Each server is started, sent the same ``--num-problems`` held-out problems
(``qwen35_jax.train.problems.held_out``: a seed training never draws) through the
official ``openai`` client as greedy completions, scored GSM8K's way (the number after
``####`` equals the answer) and stopped. Beside each score: how many completions are
token-identical to the aggregated server's in the same dtype (its ``logprobs`` tokens),
and the first problem where one is not (against the unquantised aggregated server: an FP8
row shows how many answers FP8 weights leave unchanged). With ``--speculative-tokens k``
(k > 0) the servers draft k tokens a step with the model's MTP head
(``--speculative-config``): their answers must be identical to the aggregated server's
without, and each row adds the acceptance length (1 + accepted / verified draft runs, from the
server's ``vllm:spec_decode_*`` counters) and the acceptance rate at each draft
position. Prints a table and writes ``<result-dir>/accuracy.json``.

Layouts: ``aggregated`` (``python -m serving.api``), ``disaggregated`` (``python -m
serving``: one prefill and one decode worker), ``tp2`` and ``ep2`` (the disaggregated
stack with both workers on a ``--tp 2`` / ``--ep 2`` mesh; on a CPU the started
processes get eight host devices through ``XLA_FLAGS``, of which the mesh takes two:
with only two, a sharded step's collectives hang on a two-core machine). On a machine with one
GPU both workers share it (``--gpu-memory-utilization`` splits it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

import httpx

from prometheus_client.parser import text_string_to_metric_families

from bench.disagg import CPU_ENGINE_FLAGS, start_server, stop_server
from serving.__main__ import gpus
from qwen35_jax.train import problems

LAYOUTS = {
    "aggregated": ("serving.api", []),
    "disaggregated": ("serving", []),
    "tp2": ("serving", ["--tp", "2"]),
    "ep2": ("serving", ["--ep", "2"]),
}
MAX_TOKENS = 96  # the longest answer is 60 tokens


async def _ask(client, model: str, prompts: list[str], concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            r = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, logprobs=0)
            c = r.choices[0]
            return {"text": c.text, "tokens": c.logprobs.tokens,
                    "finish_reason": c.finish_reason}

    return await asyncio.gather(*(one(p) for p in prompts))


def ask(url: str, prompts: list[str], concurrency: int, api_key: str = "none") -> list[dict]:
    """Greedy completions of `prompts` from the server at `url` (the official client)."""
    import openai

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key,
                                      max_retries=0, timeout=600) as client:
            model = (await client.models.list()).data[0].id
            return await _ask(client, model, prompts, concurrency)

    return asyncio.run(go())


def score(probs: list[problems.Problem], outs: list[dict]) -> dict:
    correct = [problems.extract(o["text"]) == p.answer for p, o in zip(probs, outs)]
    return {"n": len(probs), "correct": sum(correct), "exact": sum(correct) / len(probs)}


def agreement(outs: list[dict], ref: list[dict]) -> dict:
    """How many completions are token-identical to the reference's, and the first that
    is not (index, and the token where it diverges)."""
    same = [o["tokens"] == r["tokens"] for o, r in zip(outs, ref)]
    first = next((i for i, s in enumerate(same) if not s), None)
    out = {"identical": sum(same), "of": len(same), "first_difference": first}
    if first is not None:
        a, b = outs[first]["tokens"], ref[first]["tokens"]
        out["diverges_at_token"] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                                        min(len(a), len(b)))
    return out


def server_command(layout: str, model: str, dtype: str, port: int, flags: list[str]):
    module, extra = LAYOUTS[layout]
    return [sys.executable, "-m", module, "--model", model, "--dtype", dtype,
            "--port", str(port), *extra, *flags]


def server_env(layout: str) -> dict:
    env = dict(os.environ)
    if layout in ("tp2", "ep2") and not gpus():
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
    return env


def acceptance(url: str) -> dict:
    """The speculative server's acceptance: length (tokens a verify step yields a
    request: 1 + accepted / draft runs) and the rate at each draft position."""
    m = asyncio.run(_scrape(url))
    runs = m.get("vllm:spec_decode_num_drafts_total", 0.0)
    per_pos = sorted((int(k.split("position=")[1].rstrip("}")), v) for k, v in m.items()
                     if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos"))
    return {"acceptance_length": 1 + m.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
            / max(runs, 1.0), "acceptance_per_position": [v / max(runs, 1.0) for _, v in per_pos],
            "draft_runs": int(runs)}


async def _scrape(url: str) -> dict:
    """The server's Prometheus samples by name (as `bench.load.scrape`), with the
    per-position counters keyed ``name{position=i}``."""
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{url}/metrics", timeout=5.0)
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            pos = sample.labels.get("position")
            key = sample.name + (f"{{position={pos}}}" if pos is not None else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'layout':<14} {'weights':<8} {'dtype':<9} {'k':>2} {'exact':>7} {'correct':>9} "
            f"{'identical to agg.':>18} {'accept len':>10} {'s':>6}")
    out = [head, "-" * len(head)]
    for r in rows:
        same = r.get("agreement")
        ident = (f"{same['identical']}/{same['of']}" if same else
                 "(reference)" if r["layout"] == "aggregated" else "-")
        if "identical_per_repeat" in r:  # over every repeat (the reference: against its first)
            ident = f"{sum(r['identical_per_repeat'])}/{r['n'] * len(r['identical_per_repeat'])}"
        accept = f"{r['acceptance_length']:.2f}" if "acceptance_length" in r else "-"
        out.append(f"{r['layout']:<14} {r['quantization']:<8} {r['dtype']:<9} "
                   f"{r['speculative_tokens']:>2} {r['exact']:>7.1%} "
                   f"{r['correct']:>4}/{r['n']:<4} {ident:>18} {accept:>10} {r['seconds']:>6.0f}")
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-math")
    p.add_argument("--num-problems", type=int, default=200)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "fp8"],
                   help="weights as loaded, or --quantization fp8 for the servers")
    p.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS),
                   help="default: aggregated, disaggregated, tp2 (and ep2 for a MoE model)")
    p.add_argument("--speculative-tokens", nargs="+", type=int, default=[0],
                   help="drafts a step (MTP) of the aggregated server; 0: none")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="ask each server that many times (a rare race shows over many "
                        "rounds); every round's answers are compared with the reference")
    p.add_argument("--port", type=int, default=8400)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--result-dir", default="out")
    return p


def main(argv=None) -> list[dict]:
    import jax

    jax.config.update("jax_platforms", "cpu")  # a client: leave the devices to the servers
    args, server_flags = parser().parse_known_args(argv)
    from serving.llm import model_config

    moe = model_config(args.model).is_moe
    layouts = args.layouts or ["aggregated", "disaggregated", "tp2"] + (["ep2"] if moe else [])
    if "aggregated" in layouts:
        layouts = ["aggregated"] + [x for x in layouts if x != "aggregated"]
    if not gpus() and not server_flags:
        server_flags = CPU_ENGINE_FLAGS
    server_flags = server_flags + ["--log-level", "warning"]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    probs = problems.held_out(args.num_problems)
    prompts = [p.prompt for p in probs]
    rows, reference = [], {}
    os.makedirs(args.result_dir, exist_ok=True)
    runs = [(q, dtype, layout, k) for q in args.quantizations for dtype in args.dtypes
            for layout in layouts for k in args.speculative_tokens]
    for quantization, dtype, layout, k in runs:
        url = f"http://127.0.0.1:{args.port}"
        flags = server_flags + ([] if quantization == "none" else
                                ["--quantization", quantization])
        if k:
            flags = flags + ["--speculative-config",
                             json.dumps({"method": "mtp", "num_speculative_tokens": k})]
        proc = start_server(server_command(layout, args.model, dtype, args.port, flags),
                            url, args.startup_timeout, env=server_env(layout))
        try:
            t0 = time.perf_counter()
            outs = ask(url, prompts, args.concurrency)
            seconds = time.perf_counter() - t0
            again = [ask(url, prompts, args.concurrency) for _ in range(args.repeats - 1)]
            spec = acceptance(url) if k else {}
        finally:
            stop_server(proc)
        row = {"model": args.model, "layout": layout, "quantization": quantization,
               "dtype": dtype, "speculative_tokens": k, **score(probs, outs), **spec,
               "seconds": round(seconds, 1)}
        if layout == "aggregated" and quantization == "none" and k == 0:
            reference[dtype] = outs
        elif dtype in reference:
            row["agreement"] = agreement(outs, reference[dtype])
        if again and dtype in reference:  # every repeat against the reference
            row["identical_per_repeat"] = [agreement(o, reference[dtype])["identical"]
                                           for o in [outs, *again]]
        row["texts"] = [o["text"] for o in outs]
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    path = os.path.join(args.result_dir, "accuracy.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()

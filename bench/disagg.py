"""Serving benchmark over the OpenAI API, in the manner of `vllm bench serve`.

    python -m bench.disagg --model tiny --input-len 128 --output-len 32 --concurrency 1 4 16
    python -m bench.disagg --base-url http://127.0.0.1:8000 --input-len 8192 --output-len 1024 \\
        --range-ratio 0.8 --ignore-eos --concurrency 16 32 64 --num-gpus 2

Starts the disaggregated stack itself (``python -m serving``) unless
``--base-url`` names a running server; with ``--compare-aggregated`` it also
starts the aggregated server (``python -m serving.api``) and runs the same
requests against it in the same invocation.  Prompts are random token ids.
Lengths are drawn uniformly from ``[r*L, L]`` (sa-bench, the default) or
``[(1-r)*L, (1+r)*L]`` (vLLM's ``--random-range-ratio``; ``--range-convention
vllm``).  Each concurrency runs ``8 x C`` requests unless ``--num-prompts`` is
given.  Writes ``<result-dir>/disagg.json`` and ``<result-dir>/disagg.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
from tqdm.auto import tqdm


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    error: str = ""


def lengths(rng, n: int, length: int, ratio: float, convention: str) -> np.ndarray:
    if convention == "sa":
        lo, hi = int(length * ratio), length
    else:
        lo, hi = int(length * (1 - ratio)), int(length * (1 + ratio))
    return rng.integers(max(lo, 1), max(hi, 1) + 1, n)


def dataset(n: int, args, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    ins = lengths(rng, n, args.input_len, args.range_ratio, args.range_convention)
    outs = lengths(rng, n, args.output_len, args.range_ratio, args.range_convention)
    return [(rng.integers(3, vocab, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens: int,
              ignore_eos: bool) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run_level(url: str, model: str, data, concurrency: int, ignore_eos: bool,
                    desc: str) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(data), desc=desc, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def guarded(p, o):
            async with sem:
                r = await one(client, url, model, p, o, ignore_eos)
                bar.update(1)
                return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p, o) for p, o in data))
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def summarise(results: list[Result], duration: float, concurrency: int, num_gpus: int) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: ({"mean": float(np.mean(xs)) * 1e3, "median": float(np.median(xs)) * 1e3,  # noqa: E731
                      "p99": float(np.percentile(xs, 99)) * 1e3} if len(xs) else
                     {"mean": float("nan"), "median": float("nan"), "p99": float("nan")})
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration, "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
        "total_token_throughput_per_gpu": (tin + tout) / duration / num_gpus,
        "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms(tpot),
        "itl_ms": ms([x for r in ok for x in r.itl]), "e2e_ms": ms([r.e2e for r in ok]),
    }


def table(s: dict, mode: str) -> str:
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
        ("Total token throughput per GPU (tok/s):", f"{s['total_token_throughput_per_gpu']:.2f}"),
    ]
    title = f" {mode}, concurrency {s['concurrency']} "
    out = [f"{title:=^60}"]
    out += [f"{k:<45}{v:>15}" for k, v in rows]
    for title, key in (("Time to First Token", "ttft_ms"),
                       ("Time per Output Token (excl. 1st token)", "tpot_ms"),
                       ("Inter-token Latency", "itl_ms")):
        out.append(f"{title:-^60}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            out.append(f"{stat.capitalize() + ' ' + short + ' (ms):':<45}{s[key][stat]:>15.2f}")
    if s["errors"]:
        out.append(f"errors: {s['errors']}")
    return "\n".join(out + ["=" * 60])


def start_server(cmd: list[str], url: str, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, start_new_session=True)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"server not ready after {timeout:.0f} s: {' '.join(cmd)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_model(url: str) -> tuple[str, int]:
    """The served model's name, and a vocabulary bound for random prompts."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    return model["id"], int(model.get("vocab_size", 512))


def run_mode(mode: str, url: str, args, levels) -> list[dict]:
    name, vocab = served_model(url)
    vocab = min(vocab, args.vocab_limit) if args.vocab_limit else vocab
    rows = []
    for c in levels:
        n = args.num_prompts or args.prompts_per_concurrency * c
        data = dataset(n, args, vocab, seed=args.seed + c)
        results, duration = asyncio.run(run_level(url, name, data, c, args.ignore_eos,
                                                  f"{mode} C={c}"))
        s = summarise(results, duration, c, args.num_gpus if mode == "disaggregated"
                      else args.aggregated_gpus)
        s["mode"] = mode
        print(table(s, mode), flush=True)
        rows.append(s)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        c = [r["concurrency"] for r in rs]
        a.plot(c, [r["total_token_throughput_per_gpu"] for r in rs], "o-", label=mode)
        b.plot(c, [r["ttft_ms"]["median"] for r in rs], "o-", label=f"{mode} median")
        b.plot(c, [r["ttft_ms"]["p99"] for r in rs], "x--", label=f"{mode} p99")
    a.set(xlabel="concurrency", ylabel="total tokens/s per GPU", xscale="log", title="Throughput")
    b.set(xlabel="concurrency", ylabel="TTFT (ms)", xscale="log", title="Time to first token")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server; else one is started")
    p.add_argument("--model", default="tiny", help="for the started stack: preset or checkpoint")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--range-convention", choices=["sa", "vllm"], default="sa")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--prompts-per-concurrency", type=int, default=8)
    p.add_argument("--num-gpus", type=int, default=None,
                   help="devices the disaggregated stack uses (default: its worker count)")
    p.add_argument("--aggregated-gpus", type=int, default=1)
    p.add_argument("--compare-aggregated", action="store_true")
    p.add_argument("--vocab-limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--result-dir", default="out")
    args, server_flags = p.parse_known_args(argv)
    args.num_gpus = args.num_gpus or 2
    os.makedirs(args.result_dir, exist_ok=True)
    rows = []
    procs = []
    try:
        if args.base_url:
            url = args.base_url.rstrip("/")
        else:
            url = f"http://127.0.0.1:{args.port}"
            procs.append(start_server([sys.executable, "-m", "serving", "--model", args.model,
                                       "--port", str(args.port), *server_flags], url,
                                      args.startup_timeout))
        rows += run_mode("disaggregated", url, args, args.concurrency)
        if procs:
            stop_server(procs.pop())
        if args.compare_aggregated:
            agg = f"http://127.0.0.1:{args.port + 1}"
            procs.append(start_server([sys.executable, "-m", "serving.api", "--model", args.model,
                                       "--port", str(args.port + 1), *server_flags], agg,
                                      args.startup_timeout))
            rows += run_mode("aggregated", agg, args, args.concurrency)
    finally:
        for proc in procs:
            stop_server(proc)
    with open(os.path.join(args.result_dir, "disagg.json"), "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=1)
    plot(rows, os.path.join(args.result_dir, "disagg.png"))
    print(f"wrote {args.result_dir}/disagg.json and disagg.png")


if __name__ == "__main__":
    main()

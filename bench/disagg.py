"""Serving benchmark over the OpenAI API, in the manner of `vllm bench serve`.

    python -m bench.disagg                                   # CPU: the tiny model, a small sweep
    python -m bench.disagg --compare-aggregated              # + the aggregated server, same requests
    python -m bench.disagg --base-url http://127.0.0.1:8000 --input-len 8192 --output-len 1024 \\
        --range-ratio 0.8 --ignore-eos --concurrency 16 32 64 --num-gpus 2

Starts the disaggregated stack itself (``python -m serving``) unless
``--base-url`` names a running server; with ``--compare-aggregated`` it then
starts the aggregated server (``python -m serving.api``) and sends it the same
requests in the same invocation.  Flags the benchmark does not know go to the
servers it starts (to both, so give engine flags only with
``--compare-aggregated``).  For the tiny presets without engine flags the
servers get small CPU limits (``CPU_ENGINE_FLAGS``): the servers' own CPU
defaults pad every prefill step to 8 sequences, which makes a 64-token prompt
cost about five times more than it must on a CPU.

Requests are streamed completions of random token ids (``/v1/completions``,
``stream_options.include_usage``), sent all at once (or at ``--request-rate``
per second, Poisson) under ``--max-concurrency C`` semantics: at most C in
flight.  Lengths are drawn uniformly from
``[int(r*L), L]`` (sa-bench, the default convention) or from
``[floor((1-r)*L), ceil((1+r)*L)]`` (vLLM's ``--random-range-ratio``;
``--range-convention vllm``); the default ratio gives fixed lengths in both.
Each concurrency level C runs ``8 x C`` requests unless ``--num-prompts`` is
given, after ``--num-warmups`` unmeasured ones (full prompts, at most
``--warmup-output-len`` output tokens).  Metrics are vLLM's: TTFT to
the first chunk with choices, TPOT = (latency - TTFT) / (output tokens - 1)
with latency at the last such chunk, ITL between chunks, output counts from
``usage.completion_tokens``; "per GPU" divides the total token throughput by
the devices serving (for a started stack: its prefill + decode workers).
Beside those, each level reports the server's peak KV and GDN state bytes in use
(its ``/metrics`` gauges, summed over workers, sampled twice a second) and the
transfers' count, mean time and size per request; with ``--roofline`` it first
measures the device's ceilings in a child process (``python -m bench.roofline``)
and puts each level's floor beside its throughput and TPOT
(``bench.roofline.serving_floor``).  Writes ``<result-dir>/disagg.json`` (flat vLLM-style keys per run, with the
per-request lengths) and ``<result-dir>/disagg.png`` (throughput per GPU and
TTFT against concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from serving.__main__ import gpus
from serving.__main__ import parser as stack_parser

# Small engine limits for a CPU: one 64-token prefill program per sequence bucket
# (1 and 4 sequences), one 4-sequence decode program.
CPU_ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                    "--max-model-len", "256", "--prefill-token-buckets", "64",
                    "--prefill-seq-buckets", "1,4", "--decode-seq-buckets", "4"]
_ENGINE_FLAGS = {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--num-blocks", "--prefill-token-buckets", "--prefill-seq-buckets",
                 "--decode-seq-buckets"}
_TINY = {"tiny", "tiny-moe"}
MEMORY_GAUGES = ("vllm:kv_cache_bytes_in_use", "vllm:state_bytes_in_use")
TRANSFER_COUNTERS = ("vllm:kv_transfers_total", "vllm:kv_transfer_seconds_total",
                     "vllm:kv_transfer_bytes_total")


def length_bounds(length: int, ratio: float, convention: str) -> tuple[int, int]:
    """Inclusive [lo, hi] of one length: sa-bench's ``randint(int(L*r), L+1)`` or
    vLLM's ``[floor(L*(1-r)), ceil(L*(1+r))]``; never below 1 token."""
    if convention == "sa":
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"sa-bench range ratio must be in [0, 1], got {ratio}")
        lo, hi = int(length * ratio), length
    elif convention == "vllm":
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"vLLM range ratio must be in [0, 1), got {ratio}")
        lo, hi = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    else:
        raise ValueError(f"unknown range convention {convention!r}")
    return max(lo, 1), max(hi, 1)


def dataset(n: int, input_len: int, output_len: int, ratio: float, convention: str,
            vocab_size: int, seed) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs; ids avoid 0-2 (special in small vocabularies).
    `seed`: anything `np.random.default_rng` takes (the runs use [seed, concurrency])."""
    rng = np.random.default_rng(seed)
    lo, hi = length_bounds(input_len, ratio, convention)
    ins = rng.integers(lo, hi + 1, n)
    lo, hi = length_bounds(output_len, ratio, convention)
    outs = rng.integers(lo, hi + 1, n)
    return [(rng.integers(3, vocab_size, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


@dataclasses.dataclass
class Result:
    prompt_tokens: int
    ok: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    error: str = ""


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
              max_tokens: int, ignore_eos: bool) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    res = Result(prompt_tokens=len(prompt))
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
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                elif chunk.get("choices"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = last - start
        res.ok = not res.error and res.ttft > 0.0 and res.output_tokens > 0
        if not res.ok and not res.error:
            res.error = "stream ended without output or usage"
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's Prometheus samples, summed over labels, by sample name."""
    r = await client.get(f"{url}/metrics", timeout=5.0)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def watch(client: httpx.AsyncClient, url: str, done: asyncio.Event,
                interval: float = 0.5) -> dict[str, float]:
    """Peaks of the memory gauges while the level runs (as fresh as the server's own
    view: the router polls its workers once a second)."""
    peak = dict.fromkeys(MEMORY_GAUGES, 0.0)
    while not done.is_set():
        m = await scrape(client, url)
        for k in peak:
            peak[k] = max(peak[k], m.get(k, 0.0))
        try:
            await asyncio.wait_for(done.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return peak


def arrivals(n: int, rate: float, seed) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: all at once for an
    infinite rate, else a Poisson process of `rate` requests/s (vLLM's `--request-rate`,
    burstiness 1)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return (np.cumsum(gaps) - gaps[0]).tolist()


async def run_level(url: str, model: str, data, concurrency: int, ignore_eos: bool,
                    desc: str, sent_at: list[float] | None = None
                    ) -> tuple[list[Result], float, dict]:
    """Request i is sent `sent_at[i]` seconds after the start (default: all at once), and
    waits there while `concurrency` are in flight; (results in data order, seconds, server
    figures: peak memory in use and the transfer counters' increase)."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        before = await scrape(client, url)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(client, url, done))
        with tqdm(total=len(data), desc=desc, unit="req", disable=not desc) as bar:
            async def guarded(prompt, max_tokens, at):
                await asyncio.sleep(at - (time.perf_counter() - t0))
                async with sem:
                    r = await one(client, url, model, prompt, max_tokens, ignore_eos)
                bar.update(1)
                return r

            t0 = time.perf_counter()
            results = await asyncio.gather(*(guarded(p, o, at) for (p, o), at in
                                             zip(data, sent_at or [0.0] * len(data))))
            duration = time.perf_counter() - t0
        done.set()
        server = await watcher
        await asyncio.sleep(1.5)  # the router's counters lag its workers' by one poll
        after = await scrape(client, url)
    for k in TRANSFER_COUNTERS:
        server[k] = after.get(k, 0.0) - before.get(k, 0.0)
    return results, duration, server


def _stats(name: str, seconds: list[float]) -> dict:
    xs = np.asarray(seconds, dtype=float) * 1e3
    if not len(xs):
        return {f"{s}_{name}_ms": float("nan") for s in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": float(xs.mean()), f"median_{name}_ms": float(np.median(xs)),
            f"std_{name}_ms": float(xs.std()), f"p99_{name}_ms": float(np.percentile(xs, 99))}


def summarise(results: list[Result], duration: float, concurrency: int, num_gpus: int,
              server: dict) -> dict:
    """vLLM's `calculate_metrics` over the successful requests, plus throughput per GPU
    and the server's figures (peak KV and state bytes in use, transfers)."""
    ok = [r for r in results if r.ok]
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    transfers = server.get("vllm:kv_transfers_total", 0.0)
    return {
        "peak_kv_bytes": server.get("vllm:kv_cache_bytes_in_use", 0.0),
        "peak_state_bytes": server.get("vllm:state_bytes_in_use", 0.0),
        "transfers": transfers,
        "mean_transfer_ms": (1e3 * server.get("vllm:kv_transfer_seconds_total", 0.0)
                             / transfers if transfers else float("nan")),
        "mean_transfer_bytes": (server.get("vllm:kv_transfer_bytes_total", 0.0) / transfers
                                if transfers else float("nan")),
        "max_concurrency": concurrency, "num_gpus": num_gpus, "duration": duration,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration, "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
        "total_token_throughput_per_gpu": (tin + tout) / duration / num_gpus,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1)
                          for r in ok if r.output_tokens > 1]),
        **_stats("itl", [x for r in ok for x in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "chunks": [len(r.itl) + 1 if r.ok else 0 for r in results],  # streamed with choices
        "ttfts": [r.ttft for r in results],
    }


def table(s: dict) -> str:
    """The result block of `vllm bench serve`, with the mode and per-GPU throughput added."""
    line = "{:<40} {:<10}".format
    out = ["{:=^50}".format(" Serving Benchmark Result "),
           line("Mode:", s["mode"]),
           line("Successful requests:", s["completed"]),
           line("Failed requests:", s["failed"]),
           line("Maximum request concurrency:", s["max_concurrency"]),
           line("Benchmark duration (s):", f"{s['duration']:.2f}"),
           line("Total input tokens:", s["total_input_tokens"]),
           line("Total generated tokens:", s["total_output_tokens"]),
           line("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
           line("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
           line("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
           line("Total token throughput per GPU (tok/s):",
                f"{s['total_token_throughput_per_gpu']:.2f}")]
    out += [line("Peak KV + state in use (GiB):",
                 f"{s['peak_kv_bytes'] / 2**30:.2f} + {s['peak_state_bytes'] / 2**30:.2f}")]
    if s["transfers"]:
        out += [line("Transfers (mean ms, MiB per request):",
                     f"{s['transfers']:.0f} ({s['mean_transfer_ms']:.1f}, "
                     f"{s['mean_transfer_bytes'] / 2**20:.1f})")]
    if "roofline_tokens_per_s_per_gpu" in s:
        out += [line("Roofline tok/s per GPU (share):",
                     f"{s['roofline_tokens_per_s_per_gpu']:.0f} ({s['roofline_share']:.0%})"),
                line("Prefill floor tok/s per GPU:", f"{s['prefill_floor_tokens_per_s']:.0f}"),
                line("Decode step floor ms (of median TPOT):",
                     f"{s['decode_step_floor_ms']:.1f} ({s['decode_floor_share']:.0%})")]
    for title, key, short in (("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-token Latency", "itl", "ITL")):
        out.append("{:-^50}".format(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            out.append(line(f"{label} {short} (ms):", f"{s[f'{stat}_{key}_ms']:.2f}"))
    out += [f"errors: {e}" for e in s["errors"]]
    return "\n".join(out + ["=" * 50])


def summary(rows: list[dict]) -> str:
    """One line per run: the sweep at a glance (Markdown)."""
    head = ("| mode | C | ok/all | duration s | req/s | out tok/s | total tok/s | tok/s/GPU "
            "| TTFT med/p99 ms | TPOT med/p99 ms | ITL med/p99 ms | peak KV+state GiB "
            "| transfer ms/req | roofline tok/s/GPU (share) | decode floor ms (of TPOT) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        out.append(
            f"| {s['mode']} | {s['max_concurrency']} | {s['completed']}/"
            f"{s['completed'] + s['failed']} | {s['duration']:.1f} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{s['total_token_throughput']:.1f} | {s['total_token_throughput_per_gpu']:.1f} | "
            f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
            f"{s['median_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | "
            f"{s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} | "
            f"{(s['peak_kv_bytes'] + s['peak_state_bytes']) / 2**30:.2f} | "
            f"{s['mean_transfer_ms']:.1f} | " + (
                f"{s['roofline_tokens_per_s_per_gpu']:.0f} ({s['roofline_share']:.0%}) | "
                f"{s['decode_step_floor_ms']:.1f} ({s['decode_floor_share']:.0%}) |"
                if "roofline_share" in s else "- | - |"))
    return "\n".join(out)


def start_server(cmd: list[str], url: str, timeout: float, env: dict | None = None
                 ) -> subprocess.Popen:
    """Start a server in its own session (so one signal reaches it and nothing else) and
    wait for /health."""
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
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
    """Ctrl-C, as a user would: the launcher then stops its workers.  uvicorn's first
    SIGINT waits for open streams; a second one forces the exit; SIGKILL is the last
    resort (it would leave the launcher's workers, which run in their own sessions)."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGINT, 30), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def served_model(url: str) -> tuple[str, int]:
    """The served model's name and context length."""
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    return card["id"], int(card["max_model_len"])


def roofline_figures(mode: str, s: dict, results: list[Result], roof: tuple) -> dict:
    """The level's floor (bench.roofline.serving_floor) beside what it reached: total
    tokens/s per GPU, and the decode step floor against the median TPOT.  The
    disaggregated floor is that of one prefill and one decode device."""
    from bench.roofline import serving_floor

    costs, ceilings = roof
    ok = [r for r in results if r.ok]
    if not ok:
        return {}
    f = serving_floor(costs, ceilings, [r.prompt_tokens for r in ok],
                      [r.output_tokens for r in ok], s["max_concurrency"])
    per_gpu = (f["disaggregated_tokens_per_s_per_gpu"] if mode == "disaggregated"
               else f["aggregated_tokens_per_s"])
    return {"roofline_tokens_per_s_per_gpu": per_gpu,
            "roofline_share": s["total_token_throughput_per_gpu"] / per_gpu,
            "prefill_floor_tokens_per_s": f["prefill_tokens_per_s"],
            "decode_step_floor_ms": 1e3 * f["decode_step_s"],
            "decode_step_floor_bytes": f["decode_step_bytes"],
            "decode_floor_share": (1e3 * f["decode_step_s"] / s["median_tpot_ms"]
                                   if s["median_tpot_ms"] > 0 else float("nan"))}


def filler_tokenizer(model: str, result_dir: str) -> list[str]:
    """``--tokenizer DIR`` for a random-weight preset of a real vocabulary: the built-in
    BPE padded with filler tokens to the model's size (serving/assets/
    make_tiny_tokenizer.py), so every sampled id streams as text; none otherwise."""
    from qwen35_jax import get_preset
    from serving.assets import make_tiny_tokenizer

    if os.path.isdir(model) or get_preset(model).vocab_size <= make_tiny_tokenizer.VOCAB_SIZE:
        return []
    path = make_tiny_tokenizer.main(os.path.join(result_dir, "tokenizer"),
                                    get_preset(model).vocab_size)
    return ["--tokenizer", path]


def measure_roofline(args, server_flags: list[str], result_dir: str) -> tuple:
    """(model costs, ceilings): the ceilings measured by ``python -m bench.roofline`` in a
    child process on the first device before any server starts (so this process never
    holds device memory), the costs from the model's shapes."""
    from bench.roofline import abstract_costs
    from serving.api.server import parser as server_parser

    flags, _ = server_parser().parse_known_args(["--model", args.model, *server_flags])
    path = os.path.join(result_dir, "ceilings.json")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if gpus():
        env["CUDA_VISIBLE_DEVICES"] = gpus()[0]
    subprocess.run([sys.executable, "-m", "bench.roofline", "--json", path,
                    *args.ceiling_flags.split()], check=True, env=env)
    with open(path) as f:
        ceilings = json.load(f)
    dtype = flags.dtype or ("float32" if args.model in _TINY else "bfloat16")
    return abstract_costs(args.model, dtype, flags.block_size), ceilings


def run_mode(mode: str, url: str, args, num_gpus: int, roof: tuple | None,
             rows: list[dict]) -> None:
    """Every concurrency level against one server; each level's figures go to `rows` as
    soon as it ends (a later failure keeps them)."""
    name, max_model_len = served_model(url)
    longest = (length_bounds(args.input_len, args.range_ratio, args.range_convention)[1]
               + length_bounds(args.output_len, args.range_ratio, args.range_convention)[1])
    if longest > max_model_len:
        raise SystemExit(f"prompts of up to {longest} tokens with their outputs exceed the "
                         f"server's max_model_len {max_model_len}")
    if args.num_warmups:
        warm = dataset(args.num_warmups, args.input_len, args.output_len, args.range_ratio,
                       args.range_convention, args.vocab_size, seed=[args.seed, 0])
        warm = [(prompt, min(n, args.warmup_output_len)) for prompt, n in warm]
        asyncio.run(run_level(url, name, warm, args.num_warmups, args.ignore_eos, ""))
    for c in args.concurrency:
        n = args.num_prompts or args.prompts_per_concurrency * c
        data = dataset(n, args.input_len, args.output_len, args.range_ratio,
                       args.range_convention, args.vocab_size, seed=[args.seed, c])
        results, duration, server = asyncio.run(run_level(
            url, name, data, c, args.ignore_eos, f"{mode} C={c}",
            arrivals(len(data), args.request_rate, [args.seed, c])))
        s = {"mode": mode, **summarise(results, duration, c, num_gpus, server)}
        if roof is not None:
            s.update(roofline_figures(mode, s, results, roof))
        print(table(s), flush=True)
        rows.append(s)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        rs = [r for r in rows if r["mode"] == mode]
        c, color = [r["max_concurrency"] for r in rs], f"C{i}"
        a.plot(c, [r["total_token_throughput_per_gpu"] for r in rs], "o-", color=color,
               label=mode)
        b.plot(c, [r["median_ttft_ms"] for r in rs], "o-", color=color, label=f"{mode} median")
        b.plot(c, [r["p99_ttft_ms"] for r in rs], "x--", color=color, label=f"{mode} p99")
    a.set(xlabel="concurrency", ylabel="total tokens/s per GPU", title="Throughput")
    b.set(xlabel="concurrency", ylabel="TTFT (ms)", title="Time to first token")
    levels = sorted({r["max_concurrency"] for r in rows})
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server; else one is started")
    p.add_argument("--model", default="tiny", help="for started servers: preset or checkpoint")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--range-ratio", type=float, default=None,
                   help="default: fixed lengths (1.0 for sa, 0.0 for vllm)")
    p.add_argument("--range-convention", choices=["sa", "vllm"], default="sa",
                   help="sa: [int(r*L), L] (sa-bench); vllm: [floor((1-r)L), ceil((1+r)L)]")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (default inf: all at once, each "
                        "waiting for a free place under --concurrency)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="per concurrency level; default: --prompts-per-concurrency x C")
    p.add_argument("--prompts-per-concurrency", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=1,
                   help="unmeasured requests before each server's sweep")
    p.add_argument("--warmup-output-len", type=int, default=16,
                   help="output tokens of a warm-up request (at most --output-len): enough "
                        "to pass through prefill, transfer and decode once")
    p.add_argument("--num-gpus", type=int, default=None,
                   help="devices of the disaggregated server (default: a started stack's "
                        "prefill + decode workers; 1 with --base-url)")
    p.add_argument("--aggregated-gpus", type=int, default=1)
    p.add_argument("--compare-aggregated", action="store_true")
    p.add_argument("--vocab-size", type=int, default=512,
                   help="prompt token ids are drawn from [3, this); 512 fits every model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8300, help="of started servers (and port + 1)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--result-dir", default="out")
    p.add_argument("--roofline", action="store_true",
                   help="measure the device's ceilings first and put each level's roofline "
                        "beside its figures (bench.roofline)")
    p.add_argument("--ceiling-flags", default="",
                   help="flags for python -m bench.roofline (say '--ceiling-mib 64' on a CPU)")
    return p


def main(argv=None) -> None:
    import jax

    # This process is a client: shapes for the roofline, never a device (a GPU client
    # here would take memory the servers need). Its children keep their own platforms.
    jax.config.update("jax_platforms", "cpu")
    args, server_flags = parser().parse_known_args(argv)
    if args.range_ratio is None:
        args.range_ratio = 1.0 if args.range_convention == "sa" else 0.0
    if args.model in _TINY and not _ENGINE_FLAGS & {f.split("=")[0] for f in server_flags}:
        server_flags = CPU_ENGINE_FLAGS + server_flags
    if not any(f.split("=")[0] == "--tokenizer" for f in server_flags):
        server_flags += filler_tokenizer(args.model, args.result_dir)
    if not any(f.split("=")[0] == "--log-level" for f in server_flags):
        server_flags = server_flags + ["--log-level", "warning"]  # keep the progress bars legible
    os.makedirs(args.result_dir, exist_ok=True)
    # `timeout` and job control send SIGTERM: unwind through the finally below, so the
    # started servers (in their own sessions) are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    rows, procs = [], []
    roof = measure_roofline(args, server_flags, args.result_dir) if args.roofline else None
    try:
        if args.base_url:
            url, num_gpus = args.base_url.rstrip("/"), args.num_gpus or 1
        else:

            stack, _ = stack_parser().parse_known_args(["--model", args.model, *server_flags])
            num_gpus = args.num_gpus or stack.prefill_workers + stack.decode_workers
            url = f"http://127.0.0.1:{args.port}"
            procs.append(start_server([sys.executable, "-m", "serving", "--model", args.model,
                                       "--port", str(args.port), *server_flags], url,
                                      args.startup_timeout))
        run_mode("disaggregated", url, args, num_gpus, roof, rows)
        if procs:
            stop_server(procs.pop())
        if args.compare_aggregated:
            agg = f"http://127.0.0.1:{args.port + 1}"
            # On GPUs the aggregated server gets the first --aggregated-gpus devices only,
            # and XLA there 95 % of each (its cache lives in XLA's pool), as the workers'
            # caches take what their pools leave.
            env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ,
                   "CUDA_VISIBLE_DEVICES": ",".join(gpus()[:args.aggregated_gpus])
                   } if gpus() else None
            procs.append(start_server([sys.executable, "-m", "serving.api", "--model",
                                       args.model, "--port", str(args.port + 1),
                                       *server_flags], agg, args.startup_timeout, env))
            run_mode("aggregated", agg, args, args.aggregated_gpus, roof, rows)
    finally:
        for proc in procs:
            stop_server(proc)
        with open(os.path.join(args.result_dir, "disagg.json"), "w") as f:
            json.dump({"args": vars(args), "server_flags": server_flags, "results": rows}, f,
                      indent=1)
    plot(rows, os.path.join(args.result_dir, "disagg.png"))
    print(summary(rows))
    print(f"wrote {args.result_dir}/disagg.json and {args.result_dir}/disagg.png", flush=True)


if __name__ == "__main__":
    main()

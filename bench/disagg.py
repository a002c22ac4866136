"""Serving benchmark over the OpenAI API, in the manner of `vllm bench serve`.

    python -m bench.disagg                                   # CPU: the tiny model, a small sweep
    python -m bench.disagg --compare-aggregated              # + the aggregated server, same requests
    python -m bench.disagg --base-url http://127.0.0.1:8000 --input-len 8192 --output-len 1024 \\
        --range-ratio 0.8 --ignore-eos --concurrency 16 32 64 --num-gpus 2

Starts the disaggregated stack itself (``python -m serving``) unless
``--base-url`` names a running server; with ``--servers disaggregated aggregated``
(``--compare-aggregated``) it then starts the aggregated server (``python -m
serving.api``) and sends it the same requests in the same invocation (``--servers
aggregated``: that one alone), and reports per level how many greedy completions
came out identical in both modes.  Flags the benchmark does not know go to the
servers it starts (engine flags to both; the launcher's own, such as
``--prefill-workers`` or ``--decode-args``, to the disaggregated stack only).  For the tiny presets without engine flags the
servers get small CPU limits (``CPU_ENGINE_FLAGS``): the servers' own CPU
defaults pad every prefill step to 8 sequences, which makes a 64-token prompt
cost about five times more than it must on a CPU.

``--dataset-name prefix`` starts every prompt with one of ``--num-prefixes`` random
prefixes of ``--shared-prefix-len`` tokens (a shared system prompt, or the history of a
multi-turn chat); ``--prefix-caching both`` runs every server twice, with caching on and
started with ``--no-enable-prefix-caching``, and reports the token hit rate (the
servers' ``vllm:prefix_cache_*`` counters) beside TTFT and throughput.

``--dataset-name sharegpt-like`` draws lengths shaped like ShareGPT conversations'
(log-normal, long-tailed; ``bench.load.sharegpt_like_dataset``), capped at
``--input-len`` / ``--output-len``: synthetic, no data set is downloaded.

Requests are streamed completions of random token ids (``/v1/completions``,
``stream_options.include_usage``; with ``--backend openai-chat`` the ids' text as a
user message to ``/v1/chat/completions``), sent all at once (or at ``--request-rate``
per second, Poisson) under ``--max-concurrency C`` semantics (several values: a
sweep): at most C in flight.  Lengths are drawn uniformly from
``[int(r*L), L]`` (sa-bench, the default convention) or from
``[floor((1-r)*L), ceil((1+r)*L)]`` (vLLM's ``--random-range-ratio``;
``--range-convention vllm``); the default ratio gives fixed lengths in both.
Each concurrency level C runs ``8 x C`` requests unless ``--num-prompts`` is
given, after ``--num-warmups`` unmeasured ones (full prompts, at most
``--warmup-output-len`` output tokens).  Metrics are vLLM's: TTFT to
the first chunk with choices, TPOT = (latency - TTFT) / (output tokens - 1)
with latency at the last such chunk, ITL between chunks, output counts from
``usage.completion_tokens``; "per GPU" divides the total token throughput by
the devices serving (for a started stack: its prefill + decode workers);
``--percentile-metrics`` and ``--metric-percentiles`` choose what the tables print.
Beside those, each level reports the server's peak KV and GDN state bytes in use
(its ``/metrics`` gauges, summed over workers, sampled twice a second) and the
transfers' count, mean time and size per request; with ``--roofline`` it first
measures the device's ceilings in a child process (``python -m bench.roofline``)
and puts each level's floor beside its throughput and TPOT
(``bench.roofline.serving_floor``).  Writes ``<result-dir>/disagg.json`` (flat vLLM-style keys per run, with the
per-request lengths) and ``<result-dir>/disagg.png`` (throughput per GPU, TTFT and
TPOT against concurrency, and throughput per GPU against tokens/s per user; its title
names the model, the lengths and the device).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx

from bench.load import (arrivals, dataset, length_bounds, prefix_dataset, run_level, scrape,
                        sharegpt_like_dataset)
from bench.report import (NO_PREFIX_CACHE, greedy_agreement, plot, roofline_figures,
                          summarise, summary, table)
from serving.__main__ import LAUNCHER_FLAGS, gpus, wait_ready, without_flags
from serving.__main__ import parse as parse_stack_flags

# Small engine limits for a CPU: one 64-token prefill program per sequence bucket
# (1 and 4 sequences), one 4-sequence decode program.
CPU_ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                    "--max-model-len", "256", "--prefill-token-buckets", "64",
                    "--prefill-seq-buckets", "1,4", "--decode-seq-buckets", "4"]
_ENGINE_FLAGS = {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--num-blocks", "--prefill-token-buckets", "--prefill-seq-buckets",
                 "--decode-seq-buckets"}
_TINY = {"tiny", "tiny-moe"}


def start_server(cmd: list[str], url: str, timeout: float, env: dict | None = None
                 ) -> subprocess.Popen:
    """Start a server in its own session (so one signal reaches it and nothing else) and
    wait for /health."""
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        wait_ready([proc], [url], timeout)
    except SystemExit:
        stop_server(proc)
        raise
    return proc


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


def server_role(url: str) -> str:
    """"aggregated" for one engine, else "disaggregated": the roles its
    ``qwen35:device_busy_seconds`` counter names (a router names its workers' roles)."""
    async def samples():
        async with httpx.AsyncClient() as client:
            return await scrape(client, url)

    prefix = "qwen35:device_busy_seconds_total{"
    roles = {k[len(prefix):-1] for k in asyncio.run(samples()) if k.startswith(prefix)}
    return "aggregated" if roles == {"aggregated"} else "disaggregated"


def served_model(url: str) -> tuple[str, int]:
    """The served model's name and context length."""
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    return card["id"], int(card["max_model_len"])


def filler_tokenizer(model: str, result_dir: str) -> list[str]:
    """``--tokenizer DIR`` for a random-weight preset of a real vocabulary: the built-in
    BPE padded with filler tokens to the model's size (serving/assets/
    make_tiny_tokenizer.py), so every sampled id streams as text; none otherwise."""
    from qwen35_jax import builtin, get_preset
    from serving.assets import make_tiny_tokenizer

    if os.path.isdir(builtin.resolve(model)) or get_preset(model).vocab_size <= make_tiny_tokenizer.VOCAB_SIZE:
        return []
    path = make_tiny_tokenizer.main(os.path.join(result_dir, "tokenizer"),
                                    get_preset(model).vocab_size)
    return ["--tokenizer", path]


def measure_roofline(args, server_flags: list[str], result_dir: str) -> tuple:
    """(model costs, ceilings): the ceilings measured by ``python -m bench.roofline`` in a
    child process on the first device before any server starts (so this process never
    holds device memory), the costs from the model's shapes."""
    from bench.roofline import abstract_costs
    from serving.flags import server_parser

    flags, _ = server_parser().parse_known_args(["--model", args.model, *server_flags])
    path = os.path.join(result_dir, "ceilings.json")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    devices = gpus()
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices[0]
    subprocess.run([sys.executable, "-m", "bench.roofline", "--json", path,
                    *args.ceiling_flags.split()], check=True, env=env)
    with open(path) as f:
        ceilings = json.load(f)
    dtype = flags.dtype or ("float32" if args.model in _TINY else "bfloat16")
    return abstract_costs(args.model, dtype, flags.block_size), ceilings


def device_label() -> str:
    """What serves, for the plot's title: the GPU's name (nvidia-smi), else the CPU."""
    if gpus():
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=10).stdout.split("\n")
            return names[0].strip() or "GPU"
        except (OSError, subprocess.SubprocessError):
            return "GPU"
    return f"CPU ({os.cpu_count()} cores)"


def as_text(url: str, data: list[tuple[list[int], int]]) -> list[tuple[str, int]]:
    """The prompts' text, from the server's own tokenizer (/detokenize), for chat."""
    with httpx.Client(timeout=60) as client:
        return [(client.post(f"{url}/detokenize", json={"tokens": p}).json()["prompt"], n)
                for p, n in data]


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
        if args.backend == "openai-chat":
            warm = as_text(url, warm)
        asyncio.run(run_level(url, name, warm, args.num_warmups, args.ignore_eos, "",
                              backend=args.backend))
    for c in args.concurrency:
        n = args.num_prompts or args.prompts_per_concurrency * c
        data = requests(args, n, seed=[args.seed, c])
        if args.backend == "openai-chat":
            data = as_text(url, data)
        results, duration, server = asyncio.run(run_level(
            url, name, data, c, args.ignore_eos, f"{mode} C={c}",
            arrivals(len(data), args.request_rate, [args.seed, c]), args.backend))
        s = {"mode": mode, **summarise(results, duration, c, num_gpus, server,
                                       args.metric_percentiles)}
        if roof is not None:
            s.update(roofline_figures(mode, s, results, roof))
        print(table(s, args.percentile_metrics), flush=True)
        rows.append(s)


def _mode(server: str, prefix_caching: bool) -> str:
    return server if prefix_caching else server + NO_PREFIX_CACHE


def _caching_flag(on: bool) -> list[str]:
    """Nothing for caching on (the servers' default, or what the flags say)."""
    return [] if on else ["--no-enable-prefix-caching"]


def requests(args, n: int, seed) -> list[tuple[list[int], int]]:
    """A level's (prompt, max_tokens) pairs: its own draw, so each level starts cold."""
    common = (n, args.input_len, args.output_len, args.range_ratio, args.range_convention,
              args.vocab_size, seed)
    if args.dataset_name == "prefix":
        return prefix_dataset(*common, args.shared_prefix_len, args.num_prefixes)
    if args.dataset_name == "sharegpt-like":
        return sharegpt_like_dataset(n, args.input_len, args.output_len, args.vocab_size, seed)
    return dataset(*common)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    bad = set(names) - {"ttft", "tpot", "itl", "e2el"}
    if bad:
        raise argparse.ArgumentTypeError(f"unknown metrics {sorted(bad)}")
    return names


def _numbers(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


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
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                   help="openai: /v1/completions of token ids; openai-chat: "
                        "/v1/chat/completions of their text")
    p.add_argument("--dataset-name", choices=["random", "sharegpt-like", "prefix"],
                   default="random", help="sharegpt-like: ShareGPT-shaped lengths (synthetic)")
    p.add_argument("--shared-prefix-len", type=int, default=None,
                   help="prefix dataset: tokens every prompt shares with others (default: "
                        "90 %% of --input-len)")
    p.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix dataset: distinct shared prefixes, drawn in turn")
    p.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                   help="both: run each server with caching on, then off; with --base-url, "
                        "how the server runs (a label)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (default inf: all at once, each "
                        "waiting for a free place under --concurrency)")
    p.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=int,
                   nargs="+", default=[1, 2, 4], help="requests in flight; several: a sweep")
    p.add_argument("--percentile-metrics", type=_names, default=("ttft", "tpot", "itl"),
                   help="comma-separated of ttft, tpot, itl, e2el: the tables' latencies")
    p.add_argument("--metric-percentiles", type=_numbers, default=(99,),
                   help="comma-separated percentiles, e.g. 50,90,99")
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
    p.add_argument("--servers", nargs="+", choices=["disaggregated", "aggregated"],
                   default=["disaggregated"],
                   help="servers to start and measure, in this order (not with --base-url)")
    p.add_argument("--compare-aggregated", dest="servers", action="store_const",
                   const=["disaggregated", "aggregated"],
                   help="shorthand for --servers disaggregated aggregated")
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
    if args.shared_prefix_len is None:
        args.shared_prefix_len = int(0.9 * args.input_len)
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
    caching = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    try:
        if args.base_url:
            if args.prefix_caching == "both":
                raise SystemExit("--prefix-caching both restarts the servers it starts; with "
                                 "--base-url say on or off, as the server runs")
            url, num_gpus = args.base_url.rstrip("/"), args.num_gpus or 1
            run_mode(_mode(server_role(url), caching[0]), url, args, num_gpus, roof, rows)
        elif "disaggregated" in args.servers:
            stack = parse_stack_flags(["--model", args.model, *server_flags])
            num_gpus = args.num_gpus or stack.prefill_workers + stack.decode_workers
            url = f"http://127.0.0.1:{args.port}"
            for on in caching:
                procs.append(start_server([sys.executable, "-m", "serving", "--model", args.model,
                                           "--port", str(args.port), *server_flags,
                                           *_caching_flag(on)], url, args.startup_timeout))
                run_mode(_mode("disaggregated", on), url, args, num_gpus, roof, rows)
                stop_server(procs.pop())
        if "aggregated" in args.servers and not args.base_url:
            agg = f"http://127.0.0.1:{args.port + 1}"
            # On GPUs the aggregated server gets the first --aggregated-gpus devices only,
            # and XLA there 95 % of each (its cache lives in XLA's pool), as the workers'
            # caches take what their pools leave.
            devices = gpus()
            env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ,
                   "CUDA_VISIBLE_DEVICES": ",".join(devices[:args.aggregated_gpus])
                   } if devices else None
            for on in caching:
                procs.append(start_server([sys.executable, "-m", "serving.api", "--model",
                                           args.model, "--port", str(args.port + 1),
                                           *without_flags(server_flags, LAUNCHER_FLAGS),
                                           *_caching_flag(on)], agg, args.startup_timeout, env))
                run_mode(_mode("aggregated", on), agg, args, args.aggregated_gpus, roof, rows)
                stop_server(procs.pop())
    finally:
        for proc in procs:
            stop_server(proc)
        agreement = greedy_agreement(rows)
        with open(os.path.join(args.result_dir, "disagg.json"), "w") as f:
            json.dump({"args": vars(args), "server_flags": server_flags, "results": rows,
                       "greedy_agreement": agreement}, f, indent=1)
    lengths = ("ShareGPT-like lengths" if args.dataset_name == "sharegpt-like"
               else f"ISL {args.input_len} / OSL {args.output_len}")
    plot(rows, os.path.join(args.result_dir, "disagg.png"),
         f"{args.model}, {lengths}{', prefix dataset' if args.dataset_name == 'prefix' else ''}"
         f", {device_label()}")
    print(summary(rows))
    for g in agreement:
        print(f"greedy outputs at C={g['max_concurrency']}: {g['same']} of {g['compared']} "
              f"requests identical in {g['mode']} and {g['against']}"
              + (f" (first difference: request {g['first_difference']['request']}, "
                 f"character {g['first_difference']['char']})" if g["first_difference"] else ""))
    print(f"wrote {args.result_dir}/disagg.json and {args.result_dir}/disagg.png", flush=True)


if __name__ == "__main__":
    main()

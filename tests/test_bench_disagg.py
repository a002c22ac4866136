"""`python -m bench.disagg`: the request-length conventions, and one real run that starts
the disaggregated stack and the aggregated server, sends both the same requests (prompts
sharing two prefixes, with prefix caching on), and writes the table, the JSON and the
plot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import psutil
import pytest

from bench.load import arrivals, dataset, length_bounds, prefix_dataset, sharegpt_like_dataset
from bench.report import greedy_agreement
from serving.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("length, ratio, convention, bounds", [
    (8192, 0.8, "sa", (6553, 8192)),    # sa-bench: randint(int(L*r), L+1)
    (1024, 0.8, "sa", (819, 1024)),     # the article's output lengths
    (64, 1.0, "sa", (64, 64)),          # the default: fixed
    (10, 0.0, "sa", (1, 10)),           # never below one token
    (128, 0.5, "vllm", (64, 192)),      # vLLM: [floor(L(1-r)), ceil(L(1+r))]
    (10, 0.25, "vllm", (7, 13)),        # floor(7.5), ceil(12.5)
    (64, 0.0, "vllm", (64, 64)),        # vLLM's default: fixed
    (1, 0.9, "vllm", (1, 2)),
])
def test_length_bounds(length, ratio, convention, bounds):
    assert length_bounds(length, ratio, convention) == bounds


def test_arrivals_all_at_once_or_poisson():
    assert arrivals(5, float("inf"), 0) == [0.0] * 5
    at = np.asarray(arrivals(20000, 4.0, [0, 1]))
    gaps = np.diff(at)
    assert at[0] == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.25) < 0.01 and abs(gaps.std() - 0.25) < 0.01  # exponential
    assert arrivals(3, 4.0, [0, 1]) == arrivals(3, 4.0, [0, 1])
    with pytest.raises(ValueError, match="positive"):
        arrivals(3, 0.0, 0)


@pytest.mark.parametrize("ratio, convention", [(1.5, "sa"), (-0.1, "sa"), (1.0, "vllm"),
                                               (0.5, "other")])
def test_length_bounds_refuses(ratio, convention):
    with pytest.raises(ValueError):
        length_bounds(100, ratio, convention)


@pytest.mark.parametrize("convention, ratio", [("sa", 0.8), ("vllm", 0.5)])
def test_dataset_draws_uniformly_within_the_bounds(convention, ratio):
    data = dataset(4000, 40, 20, ratio, convention, vocab_size=100, seed=[0, 1])
    ins = np.array([len(p) for p, _ in data])
    outs = np.array([o for _, o in data])
    for lens, length in ((ins, 40), (outs, 20)):
        lo, hi = length_bounds(length, ratio, convention)
        assert lens.min() == lo and lens.max() == hi  # both ends are drawn
        assert abs(lens.mean() - (lo + hi) / 2) < 0.05 * (hi - lo + 1)
    ids = np.concatenate([p for p, _ in data])
    assert ids.min() == 3 and ids.max() == 99
    assert data == dataset(4000, 40, 20, ratio, convention, vocab_size=100, seed=[0, 1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    port = free_port(span=2)
    args = ["--input-len", "64", "--output-len", "8", "--range-ratio", "0.5", "--ignore-eos",
            "--dataset-name", "prefix", "--shared-prefix-len", "48", "--num-prefixes", "2",
            "--concurrency", "1", "3", "--num-prompts", "4", "--compare-aggregated",
            "--port", str(port), "--result-dir", str(out), "--startup-timeout", "600",
            "--roofline", "--ceiling-flags", "--ceiling-mib 8 --matmul-size 128"]
    proc = subprocess.run([sys.executable, "-m", "bench.disagg", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "disagg.json") as f:
        return proc.stdout, json.load(f), out, port


def test_every_request_succeeds_with_the_requested_lengths(run):
    _, result, _, _ = run
    rows = result["results"]
    assert [(r["mode"], r["max_concurrency"]) for r in rows] == [
        ("disaggregated", 1), ("disaggregated", 3), ("aggregated", 1), ("aggregated", 3)]
    for r in rows:
        data = prefix_dataset(4, 64, 8, 0.5, "sa", 512, [0, r["max_concurrency"]], 48, 2)
        assert r["completed"] == 4 and r["failed"] == 0 and r["errors"] == []
        assert r["input_lens"] == [len(p) for p, _ in data]
        assert r["output_lens"] == [o for _, o in data]  # --ignore-eos: exactly max_tokens
        assert r["total_input_tokens"] == sum(r["input_lens"])
        assert r["total_output_tokens"] == sum(r["output_lens"])


def test_json_fields_are_consistent(run):
    _, result, _, _ = run
    assert result["args"]["range_convention"] == "sa" and result["args"]["ignore_eos"]
    for r in result["results"]:
        d = r["duration"]
        assert r["num_gpus"] == (2 if r["mode"] == "disaggregated" else 1)
        assert math.isclose(r["request_throughput"] * d, r["completed"])
        assert math.isclose(r["output_throughput"] * d, r["total_output_tokens"])
        assert math.isclose(r["total_token_throughput"] * d,
                            r["total_input_tokens"] + r["total_output_tokens"])
        assert math.isclose(r["total_token_throughput_per_gpu"] * r["num_gpus"],
                            r["total_token_throughput"])
        for metric in ("ttft", "tpot", "itl", "e2el"):
            values = [r[f"{s}_{metric}_ms"] for s in ("mean", "median", "std", "p99")]
            assert all(math.isfinite(v) and v >= 0 for v in values), (metric, values)
            assert r[f"median_{metric}_ms"] <= r[f"p99_{metric}_ms"]
        assert r["median_ttft_ms"] <= r["median_e2el_ms"]


def test_transfers_and_roofline_are_reported(run):
    """Every disaggregated request moves its cache once (all have more than one output
    token); the aggregated server moves nothing; each level has a finite floor, and its
    shares are the measured figures over it."""
    _, result, out, _ = run
    with open(out / "ceilings.json") as f:
        assert json.load(f)["matmul_flops_per_s"] > 0
    for r in result["results"]:
        if r["mode"] == "disaggregated":
            assert r["transfers"] == r["completed"]
            assert r["mean_transfer_ms"] > 0 and r["mean_transfer_bytes"] > 0
            assert 0 < r["mean_transfer_ack_ms"] <= r["mean_transfer_ms"]
        else:
            assert r["transfers"] == 0 and math.isnan(r["mean_transfer_ms"])
        # each role's devices worked part of the level (they also wait on the host and
        # on arrivals), and every step took some device time
        roles = {"disaggregated": {"prefill", "decode"}, "aggregated": {"aggregated"}}
        assert set(r["device"]) == roles[r["mode"]], r["device"]
        for d in r["device"].values():
            assert 0 < d["busy_share"] and d["steps"] >= 1 and d["step_ms"] > 0, d
        # the floor is finite and positive, and each share is measured over floor (no
        # bound on the share itself: the ceilings are measured on a shared CPU)
        assert 0 < r["roofline_tokens_per_s_per_gpu"] < math.inf
        assert 0 < r["decode_step_floor_ms"] < math.inf and r["decode_step_floor_bytes"] > 0
        assert math.isclose(r["roofline_share"], r["total_token_throughput_per_gpu"]
                            / r["roofline_tokens_per_s_per_gpu"])
        if r["median_tpot_ms"] > 0:  # 0 where a loaded CPU streamed most outputs in one burst
            assert math.isclose(r["decode_floor_share"],
                                r["decode_step_floor_ms"] / r["median_tpot_ms"])
        else:
            assert math.isnan(r["decode_floor_share"])


def test_the_servers_own_ttft_splits_the_clients(run):
    """The server times each request from its handler's start, after the client sent it:
    its mean TTFT is positive and below the client's, and is its queue time plus the
    rest."""
    _, result, _, _ = run
    for r in result["results"]:
        ttft, queue, rest = (r[f"server_mean_{k}_ms"] for k in ("ttft", "queue", "rest"))
        assert 0 < ttft <= r["mean_ttft_ms"], r
        assert 0 <= queue and 0 <= rest and math.isclose(queue + rest, ttft, rel_tol=1e-3), r


def test_greedy_outputs_compared_between_modes(run):
    """float32 on CPU: every greedy completion is the same in both modes, and the run
    says so per level."""
    stdout, result, _, _ = run
    assert [(g["max_concurrency"], g["compared"], g["same"]) for g in result["greedy_agreement"]
            ] == [(1, 4, 4), (3, 4, 4)]
    assert all(g["first_difference"] is None for g in result["greedy_agreement"])
    assert ("greedy outputs at C=3: 4 of 4 requests identical in disaggregated and aggregated"
            in stdout)
    for r in result["results"]:
        assert all(t for t in r["texts"])  # every completion has text (tiny tokenizer)


def test_greedy_agreement_finds_the_first_difference():
    rows = [{"mode": "disaggregated", "max_concurrency": 2, "texts": ["abc", "abd", None]},
            {"mode": "aggregated", "max_concurrency": 2, "texts": ["abc", "abX", "zzz"]},
            {"mode": "disaggregated", "max_concurrency": 4, "texts": ["a"]}]
    assert greedy_agreement(rows) == [{"mode": "disaggregated", "against": "aggregated",
                                       "max_concurrency": 2, "compared": 2, "same": 1,
                                       "first_difference": {"request": 1, "char": 2}}]
    rows = [{"mode": m, "max_concurrency": 1, "texts": ["a"]} for m in (
        "disaggregated", "disaggregated, no prefix cache", "aggregated",
        "aggregated, no prefix cache")]
    assert [(g["mode"], g["against"]) for g in greedy_agreement(rows)] == [
        (m, "aggregated, no prefix cache") for m in ("disaggregated",
                                                     "disaggregated, no prefix cache",
                                                     "aggregated")]


def test_prefix_dataset_shares_the_heads_and_keeps_the_lengths():
    data = prefix_dataset(9, 40, 5, 0.5, "sa", 100, [0, 1], shared_prefix_len=30,
                          num_prefixes=3)
    plain = dataset(9, 40, 5, 0.5, "sa", 100, [0, 1])
    assert [len(p) for p, _ in data] == [len(p) for p, _ in plain]
    assert [o for _, o in data] == [o for _, o in plain]
    for i, (p, _) in enumerate(data):
        k = min(30, len(p) - 1)
        first = data[i % 3][0]  # the first prompt with this head
        shared = min(k, len(first) - 1)
        assert p[:shared] == first[:shared] and p[k:] == plain[i][0][k:]
    assert data[0][0][:20] != data[1][0][:20]


def test_the_run_hits_the_prefix_cache(run):
    """Prompts of 32-64 tokens sharing 48 (or all but one) with two others: later requests
    of a level hit cached blocks of 16 tokens in both modes."""
    _, result, _, _ = run
    for r in result["results"]:
        assert 0.2 < r["prefix_cache_hit_rate"] < 1, (r["mode"], r["prefix_cache_hit_rate"])


def test_prints_vllm_bench_serve_table_and_writes_the_plot(run):
    stdout, result, out, _ = run
    assert stdout.count("============ Serving Benchmark Result ============") == 4
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  "Total token throughput per GPU (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):",
                  "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"):
        assert stdout.count(label) == 4, label
    first = result["results"][0]
    assert f"{'Total generated tokens:':<40} {first['total_output_tokens']:<10}" in stdout
    with open(out / "disagg.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_started_servers_are_stopped(run):
    _, _, _, port = run
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and any(a in (str(port), str(port + 1))
                                         for a in p.info["cmdline"])]
    assert left == []


def test_sharegpt_like_lengths_are_long_tailed_within_the_caps():
    data = sharegpt_like_dataset(4000, 1024, 512, 100, seed=[0, 1])
    ins = np.array([len(p) for p, _ in data])
    outs = np.array([o for _, o in data])
    assert ins.min() >= 4 and ins.max() == 1024 and outs.min() >= 1 and outs.max() == 512
    assert 120 < np.median(ins) < 180 and 170 < np.median(outs) < 230  # log-normal medians
    assert ins.mean() > 1.3 * np.median(ins)  # a long tail to the right
    assert data == sharegpt_like_dataset(4000, 1024, 512, 100, seed=[0, 1])


def test_tables_print_the_chosen_latencies_and_percentiles():
    from bench.load import Result
    from bench.report import summarise, table

    results = [Result(prompt_tokens=10, ok=True, output_tokens=5, ttft=0.01 * i,
                      latency=0.05 * i, itl=[0.01] * 4) for i in range(1, 11)]
    s = {"mode": "aggregated", **summarise(results, 1.0, 4, 1, {}, (50, 90))}
    assert s["p50_ttft_ms"] == pytest.approx(55.0) and s["p90_e2el_ms"] == pytest.approx(455.0)
    text = table(s, ("ttft", "e2el"))
    assert "P90 TTFT (ms):" in text and "P99 E2EL (ms):" in text and "TPOT" not in text


def test_the_chat_backend_streams_through_chat_completions():
    """--backend openai-chat: the prompts' text as user messages; the prompt length is
    the server's (with the chat template's tokens)."""
    import asyncio

    import api_server
    from bench.disagg import as_text
    from bench.load import run_level

    srv = api_server.shared()
    data = as_text(srv.url, dataset(3, 12, 5, 1.0, "sa", 512, [0, 9]))
    assert all(isinstance(p, str) and p for p, _ in data)
    results, _, _ = asyncio.run(run_level(srv.url, "tiny", data, 2, True, "",
                                          backend="openai-chat"))
    for r in results:
        assert r.ok and r.output_tokens == 5 and r.text, r.error
        assert r.prompt_tokens > 12  # the template's role markers


def test_api_pace_streams_every_token_of_every_request():
    """bench.api_pace's stand-in engine behind the real app, driven by run_level: every
    request ends with its tokens, and the run takes at least its floor (the stand-in's
    own steps), so its table compares like with like."""
    from argparse import Namespace

    from bench import api_pace

    args = Namespace(concurrency=4, num_prompts=10, input_len=8, output_len=5, waits=2,
                     host_us=100.0, gil_switch_ms=None)
    r = api_pace.one_level(args, step_ms=5.0)
    assert r["ok"] == "10/10" and r["errors"] == []
    assert r["mean_step_ms"] >= 5.0  # its sleeps, and host work while requests run
    assert r["tokens"] * r["duration"] == pytest.approx(10 * 5)
    assert r["duration"] >= r["floor"] == 3 * 5 * 0.005


def test_api_pace_engine_ends_an_aborted_stream():
    """The stand-in engine keeps the contract AsyncEngine relies on: an abort returns the
    request's last output, so its stream ends ("abort") and nothing is left behind."""
    import asyncio

    from bench.api_pace import PacedEngine
    from serving.async_engine import AsyncEngine
    from serving.engine import SamplingParams

    async def go():
        ae = AsyncEngine(PacedEngine(0.002, 4))
        try:
            stream = await ae.add("a", [35, 36], SamplingParams(max_tokens=10_000))
            first = await stream.__anext__()
            await ae.abort("a")

            async def rest_of_it():
                return [o async for o in stream]
            rest = await asyncio.wait_for(rest_of_it(), 10)  # an unended stream waits for ever
            for _ in range(200):  # the counters are the engine thread's, read between steps
                if ae.stats()["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            return first, rest, ae.stats()["num_running"]
        finally:
            ae.shutdown()

    first, rest, running = asyncio.run(go())
    assert not first.finished and rest[-1].finish_reason == "abort" and running == 0


def test_run_level_reuses_the_last_used_connection_and_closes_every_client(monkeypatch):
    """Each place in flight has its own client; a request takes the one used last (its
    connection still open, where the longest idle one may have timed out), and every
    client is closed however the level ends, a request's unexpected error included."""
    import asyncio

    import httpx

    from bench import load

    clients, used = [], []

    class Tracked(httpx.AsyncClient):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            clients.append(self)

    async def scrape(client, url):
        return {}

    async def watch(client, url, done):
        await done.wait()
        return {}

    async def one(client, url, model, prompt, max_tokens, ignore_eos, backend):
        used.append(client)
        if prompt == "boom":
            raise KeyError("a malformed answer")
        await asyncio.sleep(0.01)
        return load.Result(prompt_tokens=1, ok=True)

    monkeypatch.setattr(load.httpx, "AsyncClient", Tracked)
    monkeypatch.setattr(load, "scrape", scrape)
    monkeypatch.setattr(load, "watch", watch)
    monkeypatch.setattr(load, "one", one)
    results, _, _ = asyncio.run(load.run_level("http://x", "m", [("a", 1)] * 5, 4, True, "",
                                               sent_at=[0.0, 0.05, 0.1, 0.15, 0.2]))
    assert len(results) == 5 and len({id(c) for c in used}) == 1
    assert len(clients) == 5 and all(c.is_closed for c in clients)
    clients.clear()
    with pytest.raises(ExceptionGroup) as failed:
        asyncio.run(load.run_level("http://x", "m", [("a", 1), ("boom", 1), ("a", 1)], 3,
                                   True, ""))
    assert failed.group_contains(KeyError)
    assert len(clients) == 4 and all(c.is_closed for c in clients)

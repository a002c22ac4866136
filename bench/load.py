"""The load a serving benchmark sends: request lengths, arrival times, one streamed
completion and what it got, and the server's own gauges and counters while a level runs.

Lengths are drawn uniformly from ``[int(r*L), L]`` (sa-bench) or ``[floor((1-r)*L),
ceil((1+r)*L)]`` (vLLM's ``--random-range-ratio``); arrivals are all at once or a Poisson
process (vLLM's ``--request-rate``); each request waits for a free place under the
level's concurrency, and its TTFT counts to the first chunk with choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import ssl
import time

import httpx
import numpy as np
from httpx_sse import aconnect_sse
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

MEMORY_GAUGES = ("qwen35:kv_cache_bytes_in_use", "qwen35:state_bytes_in_use")
TRANSFER_COUNTERS = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum",
                     "qwen35:kv_transfer_ack_seconds_total", "vllm:nixl_bytes_transferred_sum")
PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
# the server's own request timers (histograms: their _sum and _count), each from the HTTP
# handler's start (the body parsed): the time to first token, its wait in the engine's
# queue, and the rest
SERVER_TIMERS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds")
# per role ("prefill", "decode", "aggregated"): scraped as "<name>{role}"
DEVICE_COUNTERS = ("qwen35:device_busy_seconds_total", "qwen35:device_idle_seconds_total",
                   "qwen35:device_steps_total")


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


def sharegpt_like_dataset(n: int, max_input_len: int, max_output_len: int, vocab_size: int,
                         seed) -> list[tuple[list[int], int]]:
    """n requests of random token ids whose lengths are drawn like ShareGPT
    conversations' (`vllm bench serve --dataset-name sharegpt`'s usual load, with no
    download): log-normal, median 150 prompt and 200 output tokens, long-tailed
    (sigma 1.0 and 0.8), cut to [4, max_input_len] and [1, max_output_len]."""
    rng = np.random.default_rng(seed)
    ins = np.clip(np.rint(rng.lognormal(np.log(150), 1.0, n)), 4, max_input_len).astype(int)
    outs = np.clip(np.rint(rng.lognormal(np.log(200), 0.8, n)), 1, max_output_len).astype(int)
    return [(rng.integers(3, vocab_size, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def prefix_dataset(n: int, input_len: int, output_len: int, ratio: float, convention: str,
                   vocab_size: int, seed, shared_prefix_len: int, num_prefixes: int
                   ) -> list[tuple[list[int], int]]:
    """``dataset``'s requests whose prompts start with one of `num_prefixes` random
    prefixes of `shared_prefix_len` tokens (drawn in turn), as a shared system prompt or
    the history of a multi-turn chat: the rest of each prompt is its own, and every
    prompt keeps at least one token of its own."""
    if num_prefixes < 1 or shared_prefix_len < 0:
        raise ValueError("need num_prefixes >= 1 and shared_prefix_len >= 0")
    data = dataset(n, input_len, output_len, ratio, convention, vocab_size, seed)
    rng = np.random.default_rng([*np.atleast_1d(seed), 1])
    heads = [rng.integers(3, vocab_size, shared_prefix_len).tolist() for _ in range(num_prefixes)]
    out = []
    for i, (prompt, max_tokens) in enumerate(data):
        k = min(shared_prefix_len, len(prompt) - 1)
        out.append((heads[i % num_prefixes][:k] + prompt[k:], max_tokens))
    return out


@dataclasses.dataclass
class Result:
    prompt_tokens: int
    ok: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    error: str = ""
    text: str = ""  # the completion, to compare greedy outputs between servers


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str,
              max_tokens: int, ignore_eos: bool, backend: str = "openai") -> Result:
    """One streamed request, timed as vLLM's client does. `backend`: "openai" sends the
    prompt's token ids to /v1/completions; "openai-chat" sends its text (`prompt` is then
    a string) as a user message to /v1/chat/completions, and the prompt's length is the
    server's count (with the chat template's tokens)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    chat = backend == "openai-chat"
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    res = Result(prompt_tokens=0 if chat else len(prompt))
    start = last = time.perf_counter()
    try:
        async with aconnect_sse(client, "POST", f"{url}{path}", json=body) as source:
            r = source.response
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    continue
                chunk = json.loads(event.data)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                elif chunk.get("choices"):
                    choice = chunk["choices"][0]
                    res.text += (choice["delta"].get("content") if chat
                                 else choice.get("text")) or ""
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
        res.latency = last - start
        res.ok = not res.error and res.ttft > 0.0 and res.output_tokens > 0
        if not res.ok and not res.error:
            res.error = "stream ended without output or usage"
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's Prometheus samples by sample name, summed over labels other than
    ``role`` (a sample with one is keyed ``name{role}``)."""
    r = await client.get(f"{url}/metrics", timeout=5.0)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            role = sample.labels.get("role")
            key = f"{sample.name}{{{role}}}" if role else sample.name
            out[key] = out.get(key, 0.0) + sample.value
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
                    desc: str, sent_at: list[float] | None = None, backend: str = "openai"
                    ) -> tuple[list[Result], float, dict]:
    """Request i is sent `sent_at[i]` seconds after the start (default: all at once), and
    waits there while `concurrency` are in flight; (results in data order, seconds, server
    figures: peak memory in use and the transfer and device counters' increase).

    Each of the `concurrency` places in flight has its own client of one connection:
    httpx's pool walks every connection it holds on each request's start and end
    (``_assign_requests_to_connections``, a socket poll per idle connection), so one pool
    of 256 streams spent ~40 % of this process's time there and, when many requests ended
    at once, sent their successors seconds late (bench/RESULTS.md, "The load generator's
    own pace")."""
    timeout = httpx.Timeout(3600.0, connect=30.0)
    tls = ssl.create_default_context()  # one for all: each costs milliseconds to build
    async with contextlib.AsyncExitStack() as clients:  # every client closes, however it ends
        async def new_client(**kw) -> httpx.AsyncClient:
            return await clients.enter_async_context(httpx.AsyncClient(timeout=timeout, **kw))

        client = await new_client()
        places: asyncio.LifoQueue = asyncio.LifoQueue()  # the last used first: still connected
        for _ in range(concurrency):
            places.put_nowait(await new_client(verify=tls, limits=httpx.Limits(max_connections=1)))
        before = await scrape(client, url)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(client, url, done))
        try:
            with tqdm(total=len(data), desc=desc, unit="req", disable=not desc) as bar:
                async def guarded(prompt, max_tokens, at):
                    await asyncio.sleep(at - (time.perf_counter() - t0))
                    place = await places.get()
                    try:
                        r = await one(place, url, model, prompt, max_tokens, ignore_eos, backend)
                    finally:
                        places.put_nowait(place)
                    bar.update(1)
                    return r

                t0 = time.perf_counter()
                async with asyncio.TaskGroup() as requests:  # one failing cancels the rest
                    tasks = [requests.create_task(guarded(p, o, at)) for (p, o), at in
                             zip(data, sent_at or [0.0] * len(data))]
                duration = time.perf_counter() - t0
        finally:
            done.set()
            server = await watcher
        await asyncio.sleep(1.5)  # the router's counters lag its workers' by one poll
        after = await scrape(client, url)
    results = [t.result() for t in tasks]
    device = [k for k in after if k.split("{")[0] in DEVICE_COUNTERS]
    timers = [f"{t}{end}" for t in SERVER_TIMERS for end in ("_sum", "_count")]
    for k in (*TRANSFER_COUNTERS, *PREFIX_COUNTERS, *timers, *device):
        server[k] = after.get(k, 0.0) - before.get(k, 0.0)
    return results, duration, server

"""Disaggregated serving with real worker processes and real NIXL transfers (CPU, DRAM).

One stack per module: two prefill and two decode workers (``python -m
serving.worker``) and the router in this process, plus a spare prefill worker with a
slowed engine (``SLOW_PREFILL_WORKER``) that only its own test uses.  The reference is
the aggregated engine in this process, same weights (same preset and seed).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from serving.engine import SamplingParams
from serving.engine.buckets import Buckets
from serving.router import Router, WorkerFailed
from serving.ports import free_port


def bucket_flags(buckets: Buckets) -> list[str]:
    """A worker's flags for ``buckets``, the shapes it compiles."""
    return ["--prefill-token-buckets", ",".join(map(str, buckets.prefill_tokens)),
            "--prefill-seq-buckets", ",".join(map(str, buckets.prefill_seqs)),
            "--decode-seq-buckets", ",".join(map(str, buckets.decode_seqs))]


# The workers' shape buckets; the reference engine compiles the same ones (``_reference``).
BUCKETS = Buckets(prefill_tokens=(64, 256), prefill_seqs=(16,), decode_seqs=(16,))
FLAGS = ["--model", "tiny", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
         "--max-model-len", "512", "--block-size", "16", *bucket_flags(BUCKETS),
         "--max-logprobs", "0", "--transfer-timeout", "20", "--lease-ttl", "60",
         "--enable-fault-injection", "--log-level", "warning"]


class Stack:
    """Workers share the session's persistent compilation cache (conftest): the first one
    compiles the step programs, the others (same flags, same programs) start from it.

    ``while_compiling`` (optional) runs in this process while the first worker starts
    (loading, tracing and lowering are single-threaded, so it leaves a core idle much of
    the time): work that would otherwise wait for the whole stack (the module's reference
    engine) overlaps it. Its result is ``self.built``.

    ``spares`` (optional, name -> ``start`` keyword arguments) are workers that start
    together with the others, from the same cache, but stay out of ``self.urls`` (no
    router is given them): a test that needs a worker of its own finds its url in
    ``self.spares[name]`` and does not wait for a start of its own, which would run
    alone. Workers starting together share the CPU where a lone start leaves much of it
    idle."""

    def __init__(self, n_prefill=2, n_decode=2, while_compiling=None, spares=None):
        self.procs, self.urls, self.spares = {}, {"prefill": [], "decode": []}, {}
        self.env = dict(os.environ)
        roles = ["prefill"] * n_prefill + ["decode"] * n_decode
        self.start(roles[0])
        try:
            self.built = while_compiling() if while_compiling else None
        except BaseException:
            self.close()
            raise
        self.wait()
        for role in roles[1:]:
            self.start(role)
        for name, kwargs in (spares or {}).items():
            self.spares[name] = self.start(**kwargs, listed=False)
        self.wait()

    def start(self, role, launch=("-m", "serving.worker"), env=None, listed=True):
        """Start a worker (``listed``: in ``self.urls``, where tests find routable workers)."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.procs[url] = subprocess.Popen(
            [sys.executable, *launch, "--role", role, "--port", str(port), *FLAGS],
            start_new_session=True, env={**self.env, **(env or {})})
        if listed:
            self.urls[role].append(url)
        return url

    def wait(self, timeout=600, urls=None):
        end = time.monotonic() + timeout
        for url, p in self.procs.items():
            if urls is not None and url not in urls:
                continue
            while True:
                assert p.poll() is None, f"worker {url} died at start-up"
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < end, f"worker {url} not ready"
                time.sleep(0.5)

    def kill(self, url):
        os.killpg(self.procs[url].pid, signal.SIGKILL)
        self.procs[url].wait()

    def stats(self, url):
        return httpx.get(f"{url}/stats", timeout=5).json()

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _reference():
    """Aggregated engine, same preset and seed: the oracle for greedy tokens.

    It compiles the workers' buckets, not the default ones: 9 programs instead of 47, a
    minute less of start-up on a 2-core CPU. Its schedule still differs from the stack's
    (one engine runs prefill and decode, in mixed steps; the stack splits them over
    processes), which is what the comparison is about; that greedy tokens do not depend
    on the bucket a step is padded to is test_engine_model's assertion (several buckets
    against each prompt alone)."""
    from serving.llm import LLM

    return LLM("tiny", max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512,
               block_size=16, num_blocks=16 * 32, buckets=BUCKETS)


@pytest.fixture(scope="module")
def stack_and_reference(tmp_path_factory):
    """The stack, and the reference engine built in this process while the stack's first
    worker starts, not after the whole stack is up (see ``Stack``). The slow prefill
    worker of ``test_ack_does_not_wait_for_the_prefill_step_in_flight`` starts with the
    stack, as a spare; its step log is ``s.slow_step_log``."""
    log = tmp_path_factory.mktemp("slow-prefill") / "steps"
    slow = {"role": "prefill", "launch": ("-c", SLOW_PREFILL_WORKER),
            "env": {"SLOW_STEP_LOG": str(log), "SLOW_STEP_SECONDS": str(SLOW_STEP_SECONDS)}}
    s = Stack(while_compiling=_reference, spares={"slow-prefill": slow})
    s.slow_step_log = log
    yield s, s.built
    s.close()


@pytest.fixture(scope="module")
def stack(stack_and_reference):
    return stack_and_reference[0]


@pytest.fixture(scope="module")
def reference(stack_and_reference):
    return stack_and_reference[1]


def prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 512, int(rng.integers(1, 200))).tolist() for _ in range(n)]


async def run_all(router, batch, params):
    async def one(i, p):
        stream = await router.add(f"r{i}-{time.monotonic_ns()}", p, params)
        out = None
        async for out in stream:
            pass
        return out

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)), return_exceptions=True)


def pools_full(stack, urls, timeout=15.0):
    end = time.monotonic() + timeout
    while True:
        s = [stack.stats(u) for u in urls]
        if all(x["free_blocks"] == x["num_blocks"] and x["free_slots"] == x["num_slots"]
               and x["leases"] == 0 and x["pending_pulls"] == 0 for x in s):
            return True
        if time.monotonic() > end:
            return s
        time.sleep(0.2)


def test_32_concurrent_greedy_requests_match_aggregated_three_times(stack, reference):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for rep in range(3):
        batch = prompts(32, seed=rep)
        want = [o.token_ids for o in reference.generate(batch, params)]

        async def go():
            router = Router.from_workers(stack.urls["prefill"], stack.urls["decode"])
            return await run_all(router, batch, params)

        outs = asyncio.run(go())
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        assert [o.token_ids for o in outs] == want, f"repetition {rep}"
    all_urls = stack.urls["prefill"] + stack.urls["decode"]
    assert pools_full(stack, all_urls) is True
    decode_stats = [stack.stats(u) for u in stack.urls["decode"]]
    assert sum(s["transfers"] for s in decode_stats) == 96
    # KV blocks of a prompt are allocated consecutively and merge: few descriptors a request
    per_request = sum(s["transfer_descriptors"] for s in decode_stats) / 96
    assert per_request <= 4, per_request


SLOW_STEP_SECONDS = 5.0
SLOW_PREFILL_WORKER = """
import os, sys, time
from serving.engine.engine import Engine
from serving.worker import main

step = Engine.step

def slow_step(self):
    # After a step that dispatched a prefill, the engine thread is kept busy for
    # SLOW_STEP_SECONDS, as it is while waiting for a long prefill step on a GPU.
    before = self.stats["prefill_steps"]
    outputs = step(self)
    if self.stats["prefill_steps"] > before:
        with open(os.environ["SLOW_STEP_LOG"], "a") as log:
            print("start", time.monotonic(), file=log, flush=True)
            time.sleep(float(os.environ["SLOW_STEP_SECONDS"]))
            print("end", time.monotonic(), file=log, flush=True)
    return outputs

Engine.step = slow_step
main(sys.argv[1:])
"""


def test_ack_does_not_wait_for_the_prefill_step_in_flight(stack):
    """A prefill worker whose engine thread is busy for 5 s in each prefill step: the decode
    side's pull of an earlier request is acked, and its first output streamed, while the
    prefill worker is still inside the step of a later request (the ack is sent by the
    transfer progress thread, not between steps). Times are CLOCK_MONOTONIC, shared by the
    processes of one machine. The worker is the stack's spare (started with the stack, not
    in ``stack.urls``: no other test routes to it), so nothing has stepped it before."""
    slow, log = SLOW_STEP_SECONDS, stack.slow_step_log
    p = stack.spares["slow-prefill"]
    d = stack.urls["decode"][0]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    def steps():
        lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        return [float(t) for kind, t in lines if kind == "start"], \
            [float(t) for kind, t in lines if kind == "end"]

    def prefill(request_id, prompt, max_tokens=4):
        body = {"request_id": request_id, "prompt_token_ids": prompt,
                "params": {**params, "max_tokens": max_tokens}}
        r = httpx.post(f"{p}/prefill", json=body, timeout=120)
        r.raise_for_status()
        return r.json()

    async def decode(request_id, prompt, first):
        """(monotonic time of the first NDJSON line, all lines)"""
        body = {"request_id": request_id, "prompt_token_ids": prompt, "params": params,
                "first_token": first["token_ids"][-1], "transfer": first["transfer"]}
        lines, t_first = [], None
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", f"{d}/decode", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        t_first = t_first or time.monotonic()
                        lines.append(json.loads(line))
        return t_first, lines

    async def go(held):
        # The later request's prefill step starts; pull the held one while it runs.
        later = asyncio.ensure_future(asyncio.to_thread(prefill, "slow-later", [7] * 20, 1))
        while len(steps()[0]) < 3:  # warm-up, held, later
            await asyncio.sleep(0.05)
        before = stack.stats(d)
        t_first, lines = await decode("slow-held", [3] * 30, held)
        await later
        return t_first, lines, before

    try:
        stack.wait(urls=[p])
        warm = prefill("slow-warm", [5] * 30)  # first pull from this worker: a fresh connection
        _, lines = asyncio.run(decode("slow-warm", [5] * 30, warm))
        assert lines[-1]["finished"] and "error" not in lines[-1], lines
        held = prefill("slow-held", [3] * 30)
        t_first, lines, before = asyncio.run(go(held))
        after = stack.stats(d)
        assert lines[-1]["finished"] and len(lines[-1]["token_ids"]) == 4, lines
        starts, ends = steps()
        assert len(ends) == 3
        assert starts[2] < t_first < ends[2], (starts, ends, t_first)
        assert after["transfers"] == before["transfers"] + 1
        ack = after["transfer_ack_seconds"] - before["transfer_ack_seconds"]
        assert ack < slow / 5, ack
    finally:
        stack.kill(p)


def test_injected_transfer_error_and_timeout_fail_only_their_request(stack):
    d = stack.urls["decode"][0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def go(kind):
        router = Router(stack.urls["prefill"], [d], max_model_len=512, max_logprobs=0)
        httpx.post(f"{d}/debug/faults", json={kind: 1}).raise_for_status()
        t0 = time.monotonic()
        bad = await run_all(router, prompts(1, seed=10), params)
        took = time.monotonic() - t0
        good = await run_all(router, prompts(3, seed=11), params)
        return bad[0], took, good

    for kind in ("fail_next", "hang_next"):
        bad, took, good = asyncio.run(go(kind))
        assert isinstance(bad, WorkerFailed) and "transfer failed" in str(bad), bad
        assert took < 50, took  # the transfer timeout is 20 s; steps on a loaded CPU take seconds
        assert all(not isinstance(g, BaseException) and len(g.token_ids) == 8 for g in good)
    assert pools_full(stack, stack.urls["prefill"] + stack.urls["decode"]) is True


def _decode_lines(url, body):
    """POST /decode and return (status, parsed NDJSON lines or the error body)."""
    r = httpx.post(f"{url}/decode", json=body, timeout=60)
    if r.status_code != 200:
        return r.status_code, r.json()
    return 200, [json.loads(line) for line in r.text.splitlines() if line]


def test_malformed_and_stale_transfer_params_are_refused(stack):
    """Bad parameters are refused with 400 before anything is posted; a lease already
    consumed ends its request with a 'stale' error; neither disturbs other requests."""
    p, d = stack.urls["prefill"][0], stack.urls["decode"][0]
    source = httpx.get(f"{p}/info", timeout=5).json()
    address = source["transfer_address"]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    body = {"request_id": "bad-1", "prompt_token_ids": [3, 4, 5], "first_token": 7,
            "params": params}
    lease = "0000dead.0"  # well formed, so each case reaches the check it is about
    bad = {
        "wrong type": {"agent": 1},
        "missing keys": {"agent": source["agent"], "lease": lease},
        "bad address": {"agent": source["agent"], "lease": lease, "items": [], "ttl": 5,
                        "address": "nowhere"},
        "stale agent at a live address": {"agent": "prefill-restarted-long-ago", "lease": lease,
                                          "items": [], "ttl": 5, "address": address},
        "outside the source's regions": {"agent": source["agent"], "lease": lease, "ttl": 5,
                                         "address": address, "items": [["kv", 0, 10**12]]},
    }
    for what, transfer in bad.items():
        status, reply = _decode_lines(d, {**body, "transfer": transfer})
        assert status == 400, (what, status, reply)
        assert "transfer params" in reply["detail"], (what, reply)

    # A real prefill, pulled once (fine), then its params replayed (stale).
    prompt = prompts(1, seed=40)[0]
    first = httpx.post(f"{p}/prefill", json={"request_id": "replay-1", "prompt_token_ids": prompt,
                                             "params": params}, timeout=60).json()
    decode_body = {"prompt_token_ids": prompt, "first_token": first["token_ids"][-1],
                   "params": params, "transfer": first["transfer"]}
    status, lines = _decode_lines(d, {**decode_body, "request_id": "replay-1"})
    assert status == 200 and lines[-1]["finished"] and "error" not in lines[-1], lines
    status, lines = _decode_lines(d, {**decode_body, "request_id": "replay-2"})
    # decoding may start once the READ lands, but no token escapes before the ack refuses it
    assert status == 200 and len(lines) == 1 and "stale" in lines[0].get("error", ""), lines

    good = asyncio.run(run_all(Router(stack.urls["prefill"], [d], max_model_len=512,
                                      max_logprobs=0),
                               prompts(3, seed=41), SamplingParams(**params)))
    assert all(not isinstance(g, BaseException) and len(g.token_ids) == 4 for g in good), good
    assert pools_full(stack, stack.urls["prefill"] + [d]) is True


def test_decode_worker_killed_mid_generation(stack):
    victim = stack.urls["decode"][-1]
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go():
        router = Router(stack.urls["prefill"], [victim], max_model_len=512, max_logprobs=0)
        stream = await router.add("long-1", prompts(1, seed=20)[0], long)
        got = 0
        t0 = None
        try:
            async for out in stream:
                got += len(out.new_token_ids)
                if got >= 5 and t0 is None:
                    stack.kill(victim)
                    t0 = time.monotonic()
        except WorkerFailed as e:
            return e, time.monotonic() - t0
        return None, None

    err, took = asyncio.run(go())
    assert isinstance(err, WorkerFailed) and took < 30, (err, took)
    stack.urls["decode"].remove(victim)
    assert pools_full(stack, stack.urls["prefill"]) is True


def test_prefill_worker_killed_during_transfer(stack):
    """The decode side's pull is held back (hang) while the prefill worker dies: the
    request fails within the transfer timeout, the decode pools return to full, and the
    surviving prefill worker serves the next requests."""
    victim, survivor = stack.urls["prefill"]
    d = stack.urls["decode"][0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def go():
        router = Router([victim], [d], max_model_len=512, max_logprobs=0)
        httpx.post(f"{d}/debug/faults", json={"hang_next": 1}).raise_for_status()
        task = asyncio.ensure_future(run_all(router, prompts(1, seed=30), params))
        await asyncio.sleep(1.0)
        stack.kill(victim)
        t0 = time.monotonic()
        bad = (await task)[0]
        took = time.monotonic() - t0
        ok = await run_all(Router([survivor], [d], max_model_len=512, max_logprobs=0),
                           prompts(4, seed=31), params)
        return bad, took, ok

    bad, took, ok = asyncio.run(go())
    assert isinstance(bad, WorkerFailed), bad
    assert took < 50, took  # the transfer timeout (20 s) and a margin, as above
    assert all(not isinstance(o, BaseException) for o in ok), ok
    stack.urls["prefill"].remove(victim)
    assert pools_full(stack, [d, survivor]) is True


ROUTER_CHILD = """
import asyncio, sys
from serving.engine import SamplingParams
from serving.router import Router

async def main(prefill, decode):
    router = Router(prefill.split(","), decode.split(","), max_model_len=512, max_logprobs=0)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    streams = [await router.add(f"orphan-{i}", [5 + i] * 40, params) for i in range(3)]
    for s in streams:
        await s.__aiter__().__anext__()
    print("streaming", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_router_process_killed_mid_stream(stack):
    """The router dies with requests streaming: the decode workers see their clients
    vanish and abort; the pools return to full and a new router serves at once."""
    urls = stack.urls["prefill"][-1:], stack.urls["decode"][:1]
    child = subprocess.Popen([sys.executable, "-c", ROUTER_CHILD, *map(",".join, urls)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "streaming"
        busy = stack.stats(urls[1][0])
        assert busy["num_running"] + busy["num_waiting"] >= 1, busy
    finally:
        child.kill()
        child.wait()
    assert pools_full(stack, urls[0] + urls[1], timeout=30) is True
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ok = asyncio.run(run_all(Router(*urls, max_model_len=512, max_logprobs=0),
                             prompts(3, seed=50), params))
    assert all(not isinstance(o, BaseException) and len(o.token_ids) == 6 for o in ok), ok

"""Disaggregated serving with real worker processes and real NIXL transfers (CPU, DRAM).

One stack per module: two prefill and two decode workers (``python -m serving.worker``
whose agents inject the faults a test asks for: ``fault_worker.py``) and the router in this process, plus a spare prefill worker with a
slowed engine (``SLOW_PREFILL_WORKER``) that only its own test uses.  The reference is
the aggregated engine in this process, same weights (same preset and seed).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from serving import secret as shared_secret
from serving.engine import SamplingParams
from serving.engine.buckets import Buckets
from serving.errors import WorkerFailed
from serving.ports import free_port
from serving.router import Router

SECRET = shared_secret.generate()
AUTH = shared_secret.header(SECRET)


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
         "--log-level", "warning"]
# a worker whose agent injects the faults a test asks for (POST /debug/faults)
FAULT_WORKER = (str(pathlib.Path(__file__).with_name("fault_worker.py")),)


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
        self.env = {**os.environ, shared_secret.ENV: SECRET}
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

    def start(self, role, launch=FAULT_WORKER, env=None, listed=True):
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
                    if httpx.get(f"{url}/health", timeout=1, headers=AUTH).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < end, f"worker {url} not ready"
                time.sleep(0.5)

    def kill(self, url):
        os.killpg(self.procs[url].pid, signal.SIGKILL)
        self.procs[url].wait()

    def stats(self, url):
        return httpx.get(f"{url}/stats", timeout=5, headers=AUTH).json()

    def router(self, prefill=None, decode=None) -> Router:
        """A router over the given workers (default: every listed one)."""
        return Router(prefill or self.urls["prefill"], decode or self.urls["decode"],
                      secret=SECRET, max_model_len=512, max_logprobs=0)

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
            router = Router.from_workers(stack.urls["prefill"], stack.urls["decode"],
                                         secret=SECRET)
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


def test_follow_up_turns_hit_the_prefix_cache_on_both_sides(stack, reference):
    """Three turns of a conversation, each prompt the last one, its answer and a new
    message. The router sends each turn where its prefix went: the prefill worker
    computes from its cached prefix (its last block boundary), the decode worker pulls
    only the blocks it lacks; the tokens are the aggregated engine's without caching."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    decode_before = [stack.stats(u)["transfer_cached_tokens"] for u in stack.urls["decode"]]
    rng = np.random.default_rng(60)
    turns = [rng.integers(2, 512, 45).tolist()]

    async def go():
        router = Router.from_workers(stack.urls["prefill"], stack.urls["decode"], secret=SECRET)
        outs = []
        for turn in range(3):
            [out] = await run_all(router, [turns[-1]], params)
            assert not isinstance(out, BaseException), out
            outs.append(out)
            turns.append(turns[-1] + out.token_ids + rng.integers(2, 512, 7).tolist())
        return outs

    outs = asyncio.run(go())
    want = [o.token_ids for o in reference.generate(turns[:3], params)]
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0] + [16 * (len(t) // 16) for t in turns[:2]]
    skipped = sum(stack.stats(u)["transfer_cached_tokens"] for u in stack.urls["decode"]) \
        - sum(decode_before)
    # turn k + 1 finds turn k's prompt and all but its last answer token cached
    assert skipped == sum(16 * ((len(t) + 15) // 16) for t in turns[:2])
    assert pools_full(stack, stack.urls["prefill"] + stack.urls["decode"]) is True


def test_decode_side_full_queues_requests_instead_of_refusing(stack):
    """More concurrent requests than a decode worker has slots: the rest wait there for
    memory (their leases kept alive by their claims) instead of being refused. The first
    16 pulls are held until their timeout (hang), so all 16 slots stay reserved while the
    other four requests arrive: those queue, and once the held pulls fail and give their
    memory back they are served in full. (Early in the module: it needs both prefill
    workers, whose 32 slots hold the 16 held leases and prefill the rest.)"""
    d = stack.urls["decode"][0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _post(d, "/debug/faults", {"hang_next": 16})

    async def go():
        task = asyncio.ensure_future(run_all(stack.router(decode=[d]), prompts(20, seed=60),
                                             params))
        queued = 0
        while not task.done():
            queued = max(queued, (await asyncio.to_thread(stack.stats, d))["queued_transfers"])
            await asyncio.sleep(0.1)
        return await task, queued

    outs, queued = asyncio.run(go())
    failed = [o for o in outs if isinstance(o, BaseException)]
    served = [o for o in outs if not isinstance(o, BaseException)]
    assert queued == 4  # 16 slots held by the hung pulls
    assert len(failed) == 16 and all("transfer failed (timeout" in str(e) for e in failed)
    assert len(served) == 4 and all(len(o.token_ids) == 8 for o in served)
    assert pools_full(stack, stack.urls["prefill"] + [d]) is True


SLOW_STEP_SECONDS = 5.0
SLOW_PREFILL_WORKER = """
import os, sys, time
from serving.engine.engine import Engine
from serving.worker.__main__ import main

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


def _post(url, path, body, timeout=120):
    r = httpx.post(f"{url}{path}", json=body, timeout=timeout, headers=AUTH)
    r.raise_for_status()
    return r.json()


def register(decode_url, prefill_urls):
    """What the router does before a decode worker's first request: name the prefill
    workers it may pull from."""
    addresses = [httpx.get(f"{u}/info", headers=AUTH, timeout=5).json()["transfer_address"]
                 for u in prefill_urls]
    _post(decode_url, "/sources", {"addresses": addresses})


def test_ack_does_not_wait_for_the_prefill_step_in_flight(stack):
    """A prefill worker whose engine thread is busy for 5 s in each prefill step: the decode
    side's pull of an earlier request is acked, and its first output streamed, while the
    prefill worker is still inside the step of a later request (the ack is sent by the
    transfer progress thread, not between steps; the outputs wait for the ack). Times are
    CLOCK_MONOTONIC, shared by the processes of one machine. The worker is the stack's
    spare (started with the stack, not in ``stack.urls``: no other test routes to it), so
    nothing has stepped it before."""
    log = stack.slow_step_log
    p = stack.spares["slow-prefill"]
    d = stack.urls["decode"][0]
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    def steps():
        lines = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        return [float(t) for kind, t in lines if kind == "start"], \
            [float(t) for kind, t in lines if kind == "end"]

    def prefill(request_id, prompt, max_tokens=4):
        return _post(p, "/prefill", {"request_id": request_id, "prompt_token_ids": prompt,
                                     "params": {**params, "max_tokens": max_tokens}})

    async def decode(request_id, prompt, first):
        """(monotonic time of the request's first frame, all its frames)"""
        body = {"request_id": request_id, "prompt_token_ids": prompt, "params": params,
                "first_token": first["token_ids"][-1], "transfer": first["transfer"]}
        lines, t_first = [], None
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            async with client.stream("GET", f"{d}/outputs") as out:
                it = out.aiter_lines()
                body["channel"] = json.loads(await anext(it))["channel"]
                (await client.post(f"{d}/decode", json=body)).raise_for_status()
                async for line in it:
                    for frame in json.loads(line)["frames"] if line else []:
                        t_first = t_first or time.monotonic()
                        lines.append(frame)
                    if lines and lines[-1]["finished"]:
                        break
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
        register(d, stack.urls["prefill"] + [p])
        warm = prefill("slow-warm", [5] * 30)  # first pull from this worker: a fresh connection
        _, lines = asyncio.run(decode("slow-warm", [5] * 30, warm))
        assert lines[-1]["finished"] and lines[-1]["error"] is None, lines
        held = prefill("slow-held", [3] * 30)
        t_first, lines, before = asyncio.run(go(held))
        after = stack.stats(d)
        assert lines[-1]["finished"] and sum(len(x["new_token_ids"]) for x in lines) == 3, lines
        starts, ends = steps()
        assert len(ends) == 3
        assert starts[2] < t_first < ends[2], (starts, ends, t_first)
        assert after["transfers"] == before["transfers"] + 1
    finally:
        stack.kill(p)
        register(d, stack.urls["prefill"])


def test_injected_transfer_error_and_timeout_fail_only_their_request(stack):
    d = stack.urls["decode"][0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def go(kind):
        router = stack.router(decode=[d])
        _post(d, "/debug/faults", {kind: 1})
        bad = await run_all(router, prompts(1, seed=10), params)
        good = await run_all(router, prompts(3, seed=11), params)
        return bad[0], good

    for kind, event in (("fail_next", "error: posting READ failed: injected"),
                        ("hang_next", "timeout: no completion")):
        bad, good = asyncio.run(go(kind))
        assert isinstance(bad, WorkerFailed) and f"transfer failed ({event}" in str(bad), bad
        assert all(not isinstance(g, BaseException) and len(g.token_ids) == 8 for g in good)
    assert pools_full(stack, stack.urls["prefill"] + stack.urls["decode"]) is True


def _decode_lines(url, body):
    """Open an output channel, POST /decode naming it, and return (status, the request's
    frames or the error body)."""
    with httpx.Client(timeout=60, headers=AUTH) as client:
        with client.stream("GET", f"{url}/outputs") as out:
            lines = out.iter_lines()
            r = client.post(f"{url}/decode",
                            json={**body, "channel": json.loads(next(lines))["channel"]})
            if r.status_code != 200:
                return r.status_code, r.json()
            frames = []
            for line in lines:
                frames += json.loads(line)["frames"] if line else []
                if frames and frames[-1]["finished"]:
                    return 200, frames
    raise AssertionError(f"the output channel closed after {frames}")


def test_forged_and_replayed_transfers_are_refused(stack):
    """What a decode worker reads comes from the source's answer to its claim: a body
    naming byte items, blocks or a slot, a ticket of another request, an address no
    router registered or a lease already pulled is refused before anything is read, and
    none of it disturbs other requests."""
    p, d = stack.urls["prefill"][0], stack.urls["decode"][0]
    register(d, stack.urls["prefill"])
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    def prefill(request_id, prompt):
        return _post(p, "/prefill", {"request_id": request_id, "prompt_token_ids": prompt,
                                     "params": params})

    victim, attacker = prompts(2, seed=40)
    v, a = prefill("victim", victim), prefill("attacker", attacker)
    body = {"request_id": "forged", "prompt_token_ids": attacker,
            "first_token": a["token_ids"][-1], "params": params}
    before = stack.stats(d)
    forged = {
        "items in the ticket": ({**a["transfer"], "items": [["kv", 0, 10**6]]}, 400,
                                "Extra inputs are not permitted"),
        "a cache record": ({**a["transfer"], "cache": {"blocks": [0], "slot": 0}}, 400,
                           "Extra inputs are not permitted"),
        "the victim's lease": (v["transfer"], 400, "holds the state of another request"),
        "an unregistered address": ({**a["transfer"], "address": ["127.0.0.1", 1]}, 400,
                                    "not a prefill worker the router registered"),
    }
    for what, (transfer, status, message) in forged.items():
        code, reply = _decode_lines(d, {**body, "transfer": transfer})
        assert code == status and message in reply["detail"], (what, code, reply)
    assert stack.stats(d)["transfers"] == before["transfers"]  # nothing was read

    # each lease pulled once, by its own request; then a replay is refused
    for name, prompt, first in (("victim", victim, v), ("attacker", attacker, a)):
        code, lines = _decode_lines(d, {"request_id": name, "prompt_token_ids": prompt,
                                        "first_token": first["token_ids"][-1],
                                        "params": params, "transfer": first["transfer"]})
        assert code == 200 and lines[-1]["finished"] and lines[-1]["error"] is None, lines
    code, reply = _decode_lines(d, {**body, "request_id": "replay", "transfer": a["transfer"]})
    assert code == 502 and "stale" in reply["detail"], reply

    good = asyncio.run(run_all(stack.router(decode=[d]), prompts(3, seed=41),
                               SamplingParams(**params)))
    assert all(not isinstance(g, BaseException) and len(g.token_ids) == 4 for g in good), good
    assert pools_full(stack, stack.urls["prefill"] + [d]) is True


def test_bad_worker_input_is_a_400_and_the_engine_serves_on(stack):
    """A token id that would overflow int32 in the step, ids outside the vocabulary and a
    body without request_id are refused at the worker; the engine thread lives on."""
    p = stack.urls["prefill"][0]
    good = {"request_id": "fine", "prompt_token_ids": [5, 6, 7],
            "params": {"max_tokens": 1, "temperature": 0.0}}
    for body, message in (({**good, "prompt_token_ids": [5, 2**40]}, "prompt_token_ids.1"),
                          ({**good, "prompt_token_ids": [5, 512]}, "not a token id"),
                          ({**good, "prompt_token_ids": [-3]}, "prompt_token_ids.0"),
                          ({k: v for k, v in good.items() if k != "request_id"}, "request_id")):
        r = httpx.post(f"{p}/prefill", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and message in r.json()["detail"], r.text
    assert _post(p, "/prefill", good)["finish_reason"] == "length"
    assert httpx.post(f"{p}/prefill", json=good, timeout=60).status_code == 401


def test_decode_worker_killed_mid_generation(stack):
    victim = stack.urls["decode"][-1]
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go():
        router = stack.router(decode=[victim])
        stream = await router.add("long-1", prompts(1, seed=20)[0], long)
        got, killed = 0, False
        try:
            async for out in stream:
                got += len(out.new_token_ids)
                if got >= 5 and not killed:
                    stack.kill(victim)
                    killed = True
        except WorkerFailed as e:
            return e, got
        return None, got

    # liveness bound: the router's stream ends as soon as the worker's connection does
    err, got = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert isinstance(err, WorkerFailed) and got < 400, (err, got)
    stack.urls["decode"].remove(victim)
    assert pools_full(stack, stack.urls["prefill"]) is True


def test_prefill_worker_killed_during_transfer(stack):
    """The decode side's pull is held back (hang) while the prefill worker dies: the
    request fails when the pull's deadline passes, the decode pools return to full, and the
    surviving prefill worker serves the next requests. The kill waits for the pull to be
    pending (a protocol event, not a sleep: a kill during the prefill would leave the hang
    to the next request)."""
    victim, survivor = stack.urls["prefill"]
    d = stack.urls["decode"][0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def go():
        router = stack.router(prefill=[victim], decode=[d])
        _post(d, "/debug/faults", {"hang_next": 1})
        task = asyncio.ensure_future(run_all(router, prompts(1, seed=30), params))
        while stack.stats(d)["pending_pulls"] == 0:
            assert not task.done(), task.result()
            await asyncio.sleep(0.05)
        stack.kill(victim)
        bad = (await task)[0]
        ok = await run_all(stack.router(prefill=[survivor], decode=[d]), prompts(4, seed=31),
                           params)
        return bad, ok

    bad, ok = asyncio.run(asyncio.wait_for(go(), timeout=240))
    assert isinstance(bad, WorkerFailed) and "transfer failed" in str(bad), bad
    assert all(not isinstance(o, BaseException) for o in ok), ok
    stack.urls["prefill"].remove(victim)
    assert pools_full(stack, [d, survivor]) is True


ROUTER_CHILD = """
import asyncio, os, sys
from serving.engine import SamplingParams
from serving.router import Router

async def main(prefill, decode):
    router = Router(prefill.split(","), decode.split(","), secret=os.environ["QWEN35_JAX_SECRET"],
                    max_model_len=512, max_logprobs=0)
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
                             stdout=subprocess.PIPE, text=True, env=stack.env)
    try:
        assert child.stdout.readline().strip() == "streaming"
        busy = stack.stats(urls[1][0])
        assert busy["num_running"] + busy["num_waiting"] >= 1, busy
    finally:
        child.kill()
        child.wait()
    assert pools_full(stack, urls[0] + urls[1], timeout=30) is True
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ok = asyncio.run(run_all(stack.router(*urls), prompts(3, seed=50), params))
    assert all(not isinstance(o, BaseException) and len(o.token_ids) == 6 for o in ok), ok


def test_workers_listen_on_loopback_only(stack):
    """Nothing of a worker listens beyond loopback by default: its HTTP API, its
    handshake endpoint, and UCX's transports (UCX_NET_DEVICES=lo unless
    --transfer-interface names a device)."""
    import psutil

    for url in stack.urls["prefill"] + stack.urls["decode"]:
        proc = psutil.Process(stack.procs[url].pid)
        listening = [c.laddr for c in proc.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 3, listening  # HTTP, handshake, UCX
        assert all(a.ip in ("127.0.0.1", "::1") for a in listening), (url, listening)

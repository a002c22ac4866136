"""The disaggregated server (``python -m serving``) answers as the aggregated one
(``python -m serving.api``): the same OpenAI requests, sent to both with the official
client, get the same whole responses (greedy or seeded, float32; ids and timestamps
aside, logprobs to float32 rounding). Both refuse the same bad input the same way, both
require the API key, and the launcher restarts a worker that dies.

Both servers serve the trained ``tiny-math`` model with the same engine flags
(bench.disagg's CPU limits), and its held-out problems get the same greedy answers,
token for token, from both (bf16: test_accuracy).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from bench import accuracy
from bench.disagg import CPU_ENGINE_FLAGS
from qwen35_jax.train import problems
from serving.ports import free_port

KEY = "parity-test-key"
MAX_BYTES = 1 << 20
MODEL = "tiny-math"  # trained: greedy answers are checkable, and bf16 has no near-ties
# the drafting stack: k = 2 drafts a step (the prefill worker drafts after the first
# token and ships them, the decode worker verifies them first and drafts on)
SPEC = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
FLAGS = ["--model", MODEL, *CPU_ENGINE_FLAGS, "--api-key", KEY, "--max-logprobs", "5",
         "--max-request-bytes", str(MAX_BYTES), "--log-level", "warning"]


def _start(module: str, log, extra=()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, *FLAGS, *extra, "--port", str(port)],
                            start_new_session=True, stderr=log)
    proc.log = log
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc, url, timeout=600):
    end = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{proc.args} exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, f"{url} not ready"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def all_servers(tmp_path_factory):
    """The aggregated server, the disaggregated one, and a disaggregated one whose
    workers draft with the MTP head (``SPEC``): name -> (process, url).

    The aggregated server starts first, alone; the two disaggregated stacks start once it
    is up. Their workers run the same engine flags, so the step programs the aggregated
    server compiled are in the session's compilation cache by then and are loaded, not
    compiled again by each of the four workers at once (only the drafting workers' own
    programs are compiled)."""
    logs = tmp_path_factory.mktemp("parity")
    started = {"aggregated": _start("serving.api", open(logs / "aggregated.log", "w"))}
    try:
        _wait(*started["aggregated"])
        started["disaggregated"] = _start("serving", open(logs / "launcher.log", "w"))
        started["drafting"] = _start("serving", open(logs / "drafting.log", "w"), SPEC)
        for proc, url in started.values():
            _wait(proc, url)
        yield started
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:  # its workers run in sessions of their own
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def servers(all_servers):
    """(aggregated url, disaggregated url, the launcher's process); the launcher's log is
    ``launcher.log.name``."""
    agg, disagg = all_servers["aggregated"], all_servers["disaggregated"]
    return agg[1], disagg[1], disagg[0]


def _client(url, key=KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _same(a, b, path="response"):
    """Equal, floats to float32 rounding (each server's steps are shaped differently)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, a.keys(), b.keys())
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (path, a, b)
    else:
        assert a == b, (path, a, b)


def _whole(response) -> dict:
    d = response.model_dump()
    d.pop("id"), d.pop("created")
    return d


GREEDY = {"temperature": 0, "max_tokens": 8}
COMPLETIONS = {
    "text": {"prompt": "Hello world", **GREEDY},
    "eos allowed": {"prompt": "Once upon", "temperature": 0, "max_tokens": 24},
    "logprobs 0": {"prompt": "Hello", "logprobs": 0, **GREEDY},
    "logprobs 1": {"prompt": "Hello", "logprobs": 1, **GREEDY},
    "logprobs 5": {"prompt": "Hello", "logprobs": 5, **GREEDY},
    "echo": {"prompt": "Echo me", "echo": True, **GREEDY},
    "token ids": {"prompt": [5, 6, 7, 8, 9], **GREEDY},
    "several prompts": {"prompt": ["one", "two three"], **GREEDY},
    "lists of ids": {"prompt": [[5, 6], [7, 8, 9]], **GREEDY},
    "one token": {"prompt": "Only the first", "temperature": 0, "max_tokens": 1,
                  "logprobs": 2},
    "seeded n=2": {"prompt": "Sample", "n": 2, "seed": 11, "temperature": 0.8, "top_p": 0.9,
                   "max_tokens": 12, "extra_body": {"top_k": 20, "min_p": 0.05}},
    "stop string": {"prompt": "Stop here", "stop": ["e"], "temperature": 0, "max_tokens": 16},
    "stop kept": {"prompt": "Stop here", "stop": ["e"], "temperature": 0, "max_tokens": 16,
                  "extra_body": {"include_stop_str_in_output": True}},
    "stop token": {"prompt": "Stop here", "temperature": 0, "max_tokens": 16,
                   "extra_body": {"stop_token_ids": [100, 200, 300, 400], "ignore_eos": True}},
    "ignore eos": {"prompt": "Long", "temperature": 0, "max_tokens": 30,
                   "extra_body": {"ignore_eos": True}},
}
CHATS = {
    "chat": {**GREEDY},
    "chat logprobs": {"logprobs": True, **GREEDY},
    "chat top_logprobs 0": {"logprobs": True, "top_logprobs": 0, **GREEDY},
    "chat top_logprobs 2": {"logprobs": True, "top_logprobs": 2, **GREEDY},
    "chat top_logprobs 5": {"logprobs": True, "top_logprobs": 5, **GREEDY},
    "chat max_completion_tokens": {"temperature": 0, "max_completion_tokens": 3},
    "chat seeded n=2": {"n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 10},
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_held_out_problems_get_the_same_answers_token_for_token(servers):
    agg, disagg, _ = servers
    probs = problems.held_out(32)
    prompts = [p.prompt for p in probs]
    ref = accuracy.ask(agg, prompts, concurrency=4, api_key=KEY)
    outs = accuracy.ask(disagg, prompts, concurrency=4, api_key=KEY)
    assert accuracy.score(probs, ref)["exact"] >= 0.9  # the shipped model is trained
    assert accuracy.score(probs, outs) == accuracy.score(probs, ref)
    assert accuracy.agreement(outs, ref)["identical"] == len(probs)


def test_the_drafting_disaggregated_server_answers_as_the_aggregated_one(all_servers):
    """MTP drafts across disaggregation: the held-out problems' greedy answers, at a
    concurrency that keeps transfers landing while the workers step and draft, and a
    seeded sampled completion are token-identical to the aggregated server's without
    drafts, and the drafts were verified and accepted."""
    agg, spec = all_servers["aggregated"][1], all_servers["drafting"][1]
    probs = problems.held_out(48)
    prompts = [p.prompt for p in probs]
    ref = accuracy.ask(agg, prompts, concurrency=8, api_key=KEY)
    outs = accuracy.ask(spec, prompts, concurrency=8, api_key=KEY)
    assert accuracy.agreement(outs, ref)["identical"] == len(probs)
    seeded = COMPLETIONS["seeded n=2"]
    a, b = (_client(url).completions.create(model=MODEL, **seeded) for url in (agg, spec))
    _same(_whole(a), _whole(b))
    spec_metrics = accuracy.acceptance(spec)
    assert spec_metrics["acceptance_length"] > 1.5, spec_metrics


@pytest.mark.parametrize("case", list(COMPLETIONS))
def test_completions_are_the_same(servers, case):
    agg, disagg, _ = servers
    kw = {"model": MODEL, **COMPLETIONS[case]}
    _same(_whole(_client(agg).completions.create(**kw)),
          _whole(_client(disagg).completions.create(**kw)))


@pytest.mark.parametrize("case", list(CHATS))
def test_chat_completions_are_the_same(servers, case):
    agg, disagg, _ = servers
    kw = {"model": MODEL, "messages": MESSAGES, **CHATS[case]}
    _same(_whole(_client(agg).chat.completions.create(**kw)),
          _whole(_client(disagg).chat.completions.create(**kw)))


def _streamed(client, chat: bool, **kw) -> dict:
    """A stream folded into what it delivered: text per choice, logprobs, finish
    reasons, usage (chunk boundaries are each server's own)."""
    kw = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **kw}
    create = client.chat.completions.create if chat else client.completions.create
    text, logprobs, finish, usage = {}, {}, {}, None
    for chunk in create(**kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            text[c.index] = text.get(c.index, "") + piece
            if c.logprobs is not None:
                lp = c.logprobs.model_dump()
                logprobs.setdefault(c.index, []).extend(
                    lp["content"] if chat else list(zip(lp["tokens"], lp["token_logprobs"])))
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return {"text": text, "logprobs": json.loads(json.dumps(logprobs)), "finish": finish,
            "usage": usage}


@pytest.mark.parametrize("chat, kw", [
    (False, {"prompt": "Stream this", "logprobs": 2, **GREEDY}),
    (False, {"prompt": ["a", "b c"], "n": 2, "seed": 3, "temperature": 0.7, "max_tokens": 9}),
    (True, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3, **GREEDY}),
])
def test_streams_deliver_the_same(servers, chat, kw):
    agg, disagg, _ = servers
    _same(_streamed(_client(agg), chat, **kw), _streamed(_client(disagg), chat, **kw))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "\ud800 abc"}, "prompt"),
    ({"prompt": ["fine", "\udfff"]}, "prompt"),
    ({"prompt": "fine", "stop": ["\ud800"]}, "stop"),
    ({"prompt": "fine", "stop": "x\udc00"}, "stop"),
])
def test_lone_surrogates_are_the_same_400_on_both(servers, body, param):
    """JSON can carry a lone surrogate ("\\ud800"), which is no Unicode text: it can be
    neither tokenized nor encoded, so both servers refuse it as the client's mistake."""
    error = _the_same_400(servers, body)
    assert error["param"] == param and "lone surrogate" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "fine", "stop": ["a"] * 65}, "stop"),
    ({"prompt": "fine", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"prompt": "fine", "guided_regex": "a+"}, "guided_regex"),
])
def test_options_past_the_limits_or_unserved_are_the_same_400_on_both(servers, body, param):
    assert _the_same_400(servers, body)["param"] == param


def _the_same_400(servers, body) -> dict:
    """The error both servers answer a completion request of ``body`` with, sent as
    ASCII JSON (the openai client cannot encode a lone surrogate)."""
    agg, disagg, _ = servers
    answers = []
    for url in (agg, disagg):
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                         "Content-Type": "application/json"},
                       content=json.dumps({"model": MODEL, "max_tokens": 4, **body}), timeout=60)
        assert r.status_code == 400, r.text
        answers.append(r.json())
    assert answers[0] == answers[1]
    return answers[0]["error"]


def test_chat_with_a_lone_surrogate_is_a_400(servers):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi \ud83d"}]}
    for url in servers[:2]:  # raw JSON: the openai client cannot even encode it
        r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body), timeout=60,
                       headers={"Authorization": f"Bearer {KEY}",
                                "Content-Type": "application/json"})
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text


def test_the_api_key_is_required_on_both(servers):
    for url in servers[:2]:
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError) as e:
                _client(url, key=key or "none").completions.create(model=MODEL, prompt="x",
                                                                    max_tokens=1)
            assert e.value.status_code == 401
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key, as in vLLM
        assert _client(url).models.list().data[0].id == MODEL


def test_the_model_card_and_the_tokenizer_routes_are_the_same_on_both(servers):
    """vLLM's /v1/models fields (root: the checkpoint's path), /tokenize of a chat and
    /detokenize answer alike from the router and the aggregated server."""
    auth = {"Authorization": f"Bearer {KEY}"}
    answers = []
    for url in servers[:2]:
        card = _client(url).models.list().data[0].model_dump()
        card.pop("created")
        chat = httpx.post(f"{url}/tokenize", headers=auth, timeout=60,
                          json={"messages": [{"role": "user", "content": "2 + 2?"}]}).json()
        text = httpx.post(f"{url}/detokenize", headers=auth, timeout=60,
                          json={"tokens": chat["tokens"]}).json()
        answers.append((card, chat, text))
    assert answers[0] == answers[1]
    card, chat, text = answers[0]
    assert os.path.isabs(card["root"]) and card["root"].endswith(MODEL), card
    assert card["max_model_len"] == chat["max_model_len"] > chat["count"] > 0
    assert "2 + 2?" in text["prompt"]


def test_a_body_over_the_limit_is_a_413_before_it_is_read(servers):
    for url in servers[:2]:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "a " * MAX_BYTES, "max_tokens": 1})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
        assert _client(url).completions.create(model=MODEL, prompt="ok", max_tokens=1)


def _workers(launcher: subprocess.Popen, role: str) -> list[psutil.Process]:
    return [c for c in psutil.Process(launcher.pid).children(recursive=True)
            if f"--role {role}" in " ".join(c.cmdline())]


def test_a_dead_decode_worker_is_a_503_at_once_then_restarted(servers):
    """With its only decode worker gone, the router refuses requests (503) instead of
    prefilling them for nothing; the launcher restarts the worker (and says so), after
    which the stack serves again."""
    _, disagg, launcher = servers
    [decode] = _workers(launcher, "decode")
    decode.kill()
    decode.wait(30)
    client = _client(disagg)
    end = time.monotonic() + 60
    while True:  # the router's health poll (every second) learns of the death
        try:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        except openai.APIStatusError as e:
            if e.status_code == 503 and "no decode worker is live" in str(e):
                break
            assert e.status_code in (502, 503), e  # met the death before the poll did
        assert time.monotonic() < end, "no 503 after the decode worker died"
        time.sleep(0.2)
    end = time.monotonic() + 600
    while True:  # restarted on its port; the router takes it back after a good poll
        try:
            out = client.completions.create(model=MODEL, prompt="back", max_tokens=4,
                                            temperature=0)
            break
        except openai.APIStatusError:
            assert time.monotonic() < end and launcher.poll() is None
            time.sleep(1)
    assert out.usage.completion_tokens == 4
    [restarted] = _workers(launcher, "decode")
    assert restarted.pid != decode.pid


def test_sigterm_with_a_stream_open_stops_every_process(servers):
    """Last in this module: SIGTERM to the launcher alone, while a client is mid-stream:
    the router closes the stream after its grace period and stops both workers."""
    _, disagg, launcher = servers
    children = psutil.Process(launcher.pid).children(recursive=True)
    assert len([c for c in children if "serving.worker" in " ".join(c.cmdline())]) == 2
    stream = _client(disagg).completions.create(model=MODEL, prompt="hello", max_tokens=200,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.cmdline() for c in alive]
    with open(launcher.log.name) as log:
        assert "restarting it" in log.read()  # the restart above was logged

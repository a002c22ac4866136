"""The OpenAI-compatible server, end to end: a real uvicorn server over the
tiny preset (random weights, built-in tokenizer), driven by the official
`openai` client and by raw HTTP for what the client would refuse to send."""

import asyncio
import json
import time

import httpx
import openai
import pytest

import api_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    return api_server.shared()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(autouse=True)
def pools_full_after(server):
    """Every test leaves the engine idle with all blocks and slots free."""
    yield
    server.wait_idle()


def complete(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("max_tokens", 8)
    return client.completions.create(**kw)


# ---- completions ----------------------------------------------------------

def test_models_and_health(server, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.max_model_len == api_server.MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_idle_connection_outlives_a_client_pools_keep_alive(server):
    """A connection left idle longer than httpx's pool keeps one (5 s) is still open on the
    server (``--timeout-keep-alive``, 75 s): a client reusing it never sends a request into
    a socket the server is closing."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")
        second = conn.getresponse()
        second.read()
        assert first.status == second.status == 200
        assert conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()


def test_completion_usage_and_length(client):
    r = complete(client, prompt="Hello world", max_tokens=10, extra_body={"ignore_eos": True})
    (c,) = r.choices
    assert r.object == "text_completion" and r.model == MODEL
    assert c.finish_reason == "length" and isinstance(c.text, str)
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_prompt_forms(client):
    one = complete(client, prompt=[5, 6, 7], temperature=0)
    assert one.usage.prompt_tokens == 3
    many = complete(client, prompt=[[5, 6, 7], [8, 9]], temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text  # greedy, batched or not
    assert many.usage.prompt_tokens == 5
    texts = complete(client, prompt=["Hello", "The model"], max_tokens=4)
    assert len(texts.choices) == 2


def test_same_seed_same_text(client):
    kw = dict(prompt="A request", max_tokens=12, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a, b = complete(client, **kw), complete(client, **kw)
    assert a.choices[0].text == b.choices[0].text
    c = complete(client, **{**kw, "seed": 4321})
    assert c.choices[0].text != a.choices[0].text


def test_n_choices(client):
    r = complete(client, prompt="Two", n=3, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds 7, 8, 9
    assert r.usage.prompt_tokens == complete(client, prompt="Two").usage.prompt_tokens  # once
    assert r.usage.completion_tokens == 36


def test_logprobs_and_echo(client):
    r = complete(client, prompt="Echo me", max_tokens=5, logprobs=3,
                 extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs), lp.top_logprobs  # top 3 + the chosen one
    assert lp.text_offset[0] == 0
    echoed = complete(client, prompt="Echo me", max_tokens=5, echo=True, temperature=0,
                      extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text.startswith("Echo me") and echoed.logprobs is None


def test_null_max_tokens_is_the_rest_of_the_context(server):
    """As vLLM: an absent max_tokens is OpenAI's 16, null the rest of each prompt's context."""
    body = {"prompt": [[5, 6, 7], [5]], "temperature": 0, "ignore_eos": True}
    absent = post(server, "/v1/completions", body).json()
    null = post(server, "/v1/completions", {**body, "max_tokens": None}).json()
    assert [c["finish_reason"] for c in absent["choices"]] == ["length"] * 2
    assert absent["usage"]["completion_tokens"] == 2 * 16
    assert null["usage"]["completion_tokens"] == 2 * api_server.MAX_MODEL_LEN - 3 - 1


def test_stop_string(client):
    base = complete(client, prompt=[11, 12, 13], max_tokens=24, temperature=0,
                    extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 2] for i in range(4, len(base) - 2)
                if "\ufffd" not in base[i:i + 2] and base[i:i + 2].strip())
    cut = base[:base.index(stop)]
    r = complete(client, prompt=[11, 12, 13], max_tokens=24, temperature=0, stop=[stop],
                 extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (cut, "stop", stop)
    streamed = "".join(ch.choices[0].text for ch in complete(
        client, prompt=[11, 12, 13], max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == cut


def test_stream_matches_non_stream(client):
    kw = dict(prompt="Stream this", max_tokens=16, seed=3, extra_body={"ignore_eos": True})
    full = complete(client, **kw).choices[0].text
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_sampling_options_accepted(client):
    r = complete(client, prompt="Options", max_tokens=6, temperature=0.8, top_p=0.9, seed=1,
                 extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True,
                             "use_beam_search": False, "presence_penalty": 0})  # their no-ops
    assert r.usage.completion_tokens == 6
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, response_format={"type": "text"},
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


# ---- chat -----------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Hello, what is a token?"}]


def test_chat(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=5,
                                       logprobs=True, top_logprobs=2)
    (c,) = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    tok = server.engine.engine.tokenizer
    assert r.usage.prompt_tokens == len(tok.chat_prompt(MESSAGES))
    assert len(c.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)


def test_chat_stream(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, seed=9,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 10


# ---- bad input --------------------------------------------------------------

def post(server, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data,
                      headers={"content-type": "application/json"}, **kw)


TOO_LONG = list(range(3, 3 + api_server.MAX_MODEL_LEN))


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", ', None),  # invalid JSON
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": TOO_LONG}, "prompt"),
    ({"prompt": [1, 2, 100_000]}, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "stop": ["a"] * 65}, "stop"),  # each is searched for after every token
    ({"prompt": "x", "stop": "a" * 1025}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "guided_regex": "a+"}, "guided_regex"),  # vLLM's, not implemented here
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt": "x", "echo": True, "logprobs": 0}, "echo"),  # the prompt's logprobs too
    ({"prompt": ["x"] * 1025}, "prompt"),  # each prompt is queued: at most 1024 a request
    ({"prompt": [[5]] * 1025}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_is_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 400 and err["param"] == param
    if param:
        assert param in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
    ({"messages": MESSAGES, "max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MESSAGES, "guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
])
def test_bad_chat_is_400(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt="x", model="nope")
    assert e.value.body["param"] == "model"


def test_bad_input_does_not_disturb_others(server, client):
    kw = dict(prompt="Undisturbed", max_tokens=24, seed=11, extra_body={"ignore_eos": True})
    alone = complete(client, **kw).choices[0].text
    stream = complete(client, stream=True, **kw)
    text = next(stream).choices[0].text
    for body in ({"prompt": TOO_LONG}, {"prompt": "x", "temperature": "hot"}, "{oops"):
        assert post(server, "/v1/completions", body).status_code == 400
    text += "".join(c.choices[0].text for c in stream)
    assert text == alone


# ---- overload, disconnects, concurrency -------------------------------------

def test_overload_is_503(server, client):
    engine = server.engine
    engine.max_queued_requests = 0
    try:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == 503
        with pytest.raises(openai.InternalServerError):
            complete(client, prompt="x")
    finally:
        engine.max_queued_requests = 1024
    assert complete(client, prompt="x").choices


def test_queue_bound_under_load(server):
    """With room for 4 waiting requests, a burst of 40 gets some 503s; the rest succeed."""
    server.engine.max_queued_requests = 4

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            body = {"prompt": "burst", "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/completions", json=body)
                                          for _ in range(40)))
    try:
        codes = [r.status_code for r in asyncio.run(burst())]
    finally:
        server.engine.max_queued_requests = 1024
    assert set(codes) == {200, 503} and codes.count(200) >= 4


def _scheduled_tokens(server) -> int:
    return server.engine.engine.metrics()["scheduled_tokens"]


@pytest.fixture
def slow_steps(server):
    """Steps of at least 10 ms, so a 240-token request surely outlives its client."""
    engine = server.engine.engine
    step = engine.step

    def slow():
        time.sleep(0.01)
        return step()
    engine.step = slow
    yield
    del engine.step


def test_stream_disconnect_aborts(server, slow_steps):
    before = _scheduled_tokens(server)
    body = {"prompt": "go", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        next(r.iter_lines())
    server.wait_idle()
    assert _scheduled_tokens(server) - before < 200  # aborted, not run to the end


def test_non_stream_disconnect_aborts(server, slow_steps):
    before = _scheduled_tokens(server)
    body = {"prompt": "go", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.3)
    server.wait_idle()
    assert _scheduled_tokens(server) - before < 200


def test_64_concurrent_streams(server):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL, prompt=f"Client {i}", max_tokens=12, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason
                                                    for c in chunks if c.choices][-1]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(run()) == [(12, "length")] * 64
    server.wait_idle()


def metric_values(server) -> dict[str, float]:
    """The server's samples by name with labels, as /metrics prints them."""
    text = httpx.get(server.url + "/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics(server, client):
    label = '{model_name="tiny"}'
    server.wait_idle()
    before = metric_values(server)
    r = complete(client, prompt="metrics", max_tokens=4, extra_body={"ignore_eos": True})
    server.wait_idle()
    values = metric_values(server)

    def grew(name):
        return values[name + label] - before.get(name + label, 0)

    assert values["vllm:num_requests_running" + label] == 0
    assert values["vllm:kv_cache_usage_perc" + label] == 0
    assert values["qwen35:state_slot_usage_perc" + label] == 0
    assert grew("vllm:generation_tokens_total") == 4
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 3
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    # the per-request histograms vLLM has: one observation each, of this request's figures
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds"):
        assert grew(f"vllm:request_{name}_count") == 1, name
    assert grew("vllm:request_decode_time_seconds_sum") > 0
    assert grew("vllm:time_per_output_token_seconds_count") == 1
    assert grew("vllm:request_generation_tokens_sum") == 4
    assert grew("vllm:request_prompt_tokens_sum") == r.usage.prompt_tokens
    # tokens per step: a prefill step of the prompt, then three decode steps of one token
    assert grew("vllm:iteration_tokens_total_count") >= 4
    assert grew("vllm:iteration_tokens_total_sum") >= r.usage.prompt_tokens + 3
    # the aggregated engine moves no state: no transfer samples
    assert not any(k.startswith("vllm:nixl_xfer_time_seconds_count") for k in values)
    assert values["qwen35:compiles_during_serving_total" + label] == 0


def test_bench_labels_it_aggregated(server):
    from bench.disagg import server_role

    assert server_role(server.url) == "aggregated"


def test_a_repeated_prompt_reports_its_cached_tokens(server, client):
    """Prefix caching is on by default: a 40-token prompt again, with another ending, finds
    its first two 16-token blocks cached, says so in usage and in the vLLM counters, and
    gives the same greedy text as before."""
    def hits():
        v = metric_values(server)
        return {k: v[k + '{model_name="tiny"}']
                for k in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")}

    prompt = list(range(100, 140))
    before = hits()
    first = complete(client, prompt=prompt, temperature=0, max_tokens=6)
    again = complete(client, prompt=prompt, temperature=0, max_tokens=6)
    longer = complete(client, prompt=prompt + [7, 8], temperature=0, max_tokens=6)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert longer.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    after = hits()
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 64
    assert (after["vllm:prefix_cache_queries_total"]
            - before["vllm:prefix_cache_queries_total"]) == 40 + 40 + 42


def test_a_prompt_being_tokenized_stalls_no_other_request(server, client, monkeypatch):
    """Tokenizing runs on a worker thread: while one request's prompt is being tokenized
    (held here until the others are answered), /health and another completion are
    served. On the event loop, both would wait for it."""
    import threading

    tok = server.server.config.app.state.tokenizer
    entered, release = threading.Event(), threading.Event()
    encode = tok.encode

    def held(text, **kw):
        if text == "HELD":
            entered.set()
            release.wait(60)
        return encode(text, **kw)

    monkeypatch.setattr(tok, "encode", held)
    first = threading.Thread(target=complete, args=(client,), kwargs={"prompt": "HELD",
                                                                       "max_tokens": 1})
    first.start()
    try:
        assert entered.wait(30)
        assert httpx.get(server.url + "/health", timeout=20).status_code == 200
        assert complete(client, prompt="another", max_tokens=2).usage.completion_tokens >= 1
    finally:
        release.set()
        first.join(60)

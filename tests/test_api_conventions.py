"""What vLLM users expect of the server, through the official `openai` client: Qwen3.5
chat with tool calls (hermes and qwen3_coder parsers, streamed and not, and in the
history), reasoning (`--reasoning-parser qwen3`, `chat_template_kwargs`), the
checkpoint's sampling defaults, the routes /tokenize, /detokenize, /version and /ping,
`continuous_usage_stats` and `--stream-interval`.

The replies come from a scripted backend that answers each request with a given text,
one token per output, so what is checked is the server's reading of requests and
replies; the tokenizer and its Qwen3.5-style chat template are the built-in one's.
"""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from serving.api.app import build_app
from serving.api.chat_output import ChatParsing, ChatStream, message_fields, split
from serving.api.prepare import ServerOptions
from serving.api.text import BUILTIN_TOKENIZER, Tokenizer
from serving.engine import RequestOutput
from serving.ports import free_port

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "zip": {"type": "string"}}}}}
TOOLS_BY_NAME = {"get_weather": WEATHER["function"]}

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = {"city": "Paris", "days": 3, "metric": True, "zip": "75001"}
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


# ---- the reply parser alone --------------------------------------------------

def _every_prefix_is_a_prefix(text: str, parsing: ChatParsing) -> None:
    whole = split(text, parsing, final=True)
    for n in range(len(text) + 1):
        part = split(text[:n], parsing, final=False)
        assert whole.reasoning.startswith(part.reasoning), (n, part)
        assert whole.content.startswith(part.content), (n, part)
        assert whole.calls[:len(part.calls)] == part.calls, (n, part)


def _streamed(text: str, parsing: ChatParsing, step: int = 1) -> dict:
    stream = ChatStream(parsing)
    got = {"reasoning": "", "content": "", "calls": []}
    for n in list(range(0, len(text), step)) + [len(text)]:
        delta = stream.update(text[:n], final=n == len(text))
        if delta is None:
            continue
        got["reasoning"] += delta.reasoning_content or ""
        got["content"] += delta.content or ""
        got["calls"] += [(c.function.name, json.loads(c.function.arguments))
                         for c in delta.tool_calls or []]
    return got


@pytest.mark.parametrize("parser, call, args", [("qwen3_coder", XML_CALL, XML_ARGS),
                                                ("hermes", JSON_CALL, {"city": "Oslo"})])
def test_tool_calls_are_read_whole_and_streamed(parser, call, args):
    parsing = ChatParsing(tool_parser=parser, tools=TOOLS_BY_NAME)
    text = "Let me look.\n" + call + "\n" + call
    fields = message_fields(text, parsing)
    assert fields["content"] == "Let me look.\n\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in fields["tool_calls"]] \
        == [("get_weather", args)] * 2
    _every_prefix_is_a_prefix(text, parsing)
    for step in (1, 7):
        got = _streamed(text, parsing, step)
        assert got["content"] == fields["content"] and got["calls"] == [("get_weather", args)] * 2


@pytest.mark.parametrize("schema, value", [
    ({"type": "string"}, "12345"),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "12345"),  # pydantic's Optional[str]
    ({"type": ["string", "null"]}, "12345"),
    ({"enum": ["12345", "x"]}, "12345"),  # no type: text
    (None, "12345"),  # a parameter the tool does not declare: text
    ({"type": "integer"}, 12345),
    ({"type": "number"}, 12345),
    ({"anyOf": [{"type": "null"}, {"type": "boolean"}]}, "12345"),  # not a boolean: text
    ({"type": "object"}, 12345),  # JSON
])
def test_qwen3_coder_types_a_parameter_as_vllm_does(schema, value):
    from serving.api import tool_parsers

    properties = {} if schema is None else {"zip": schema}
    tools = {"lookup": {"name": "lookup", "parameters": {"type": "object",
                                                          "properties": properties}}}
    block = ("<function=lookup>\n<parameter=zip>\n12345\n</parameter>\n"
             "<parameter=flag>\nnull\n</parameter>\n</function>")
    name, args = tool_parsers.parse_call("qwen3_coder", block, tools)
    assert (name, json.loads(args)) == ("lookup", {"zip": value, "flag": None})


def test_a_block_that_does_not_parse_stays_content():
    parsing = ChatParsing(tool_parser="hermes", tools=TOOLS_BY_NAME)
    text = "a <tool_call>{not json}</tool_call> b <tool_call>unclosed"
    fields = message_fields(text, parsing)
    assert fields["content"] == text and fields["tool_calls"] == []
    _every_prefix_is_a_prefix(text, parsing)
    assert _streamed(text, parsing)["content"] == text
    xml = ChatParsing(tool_parser="qwen3_coder", tools=TOOLS_BY_NAME)
    stray = "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"
    assert message_fields(stray, xml)["content"] == stray


def test_tool_calls_are_content_without_a_parser():
    assert message_fields(XML_CALL, ChatParsing())["content"] == XML_CALL


@pytest.mark.parametrize("prompt_end, reply, reasoning, content", [
    ("<|im_start|>assistant\n<think>\n", "I add 2 and 2.\n</think>\n\nIt is 4.",
     "I add 2 and 2.\n", "It is 4."),
    ("<|im_start|>assistant\n", "<think>\nHm.\n</think>\n\nFour.", "\nHm.\n", "Four."),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Four.", None, "Four."),
    ("<|im_start|>assistant\n<think>\n", "Still thinking", "Still thinking", None),
])
def test_reasoning_is_split_from_the_answer(prompt_end, reply, reasoning, content):
    parsing = ChatParsing.of("<|im_start|>user\nhi<|im_end|>\n" + prompt_end, True,
                             "qwen3_coder", TOOLS_BY_NAME)
    fields = message_fields(reply, parsing)
    assert fields["reasoning_content"] == reasoning
    assert (fields["content"] or None) == content
    _every_prefix_is_a_prefix(reply, parsing)
    got = _streamed(reply, parsing)
    assert got["reasoning"] == (reasoning or "") and got["content"] == (content or "")
    thought_then_call = message_fields("Need weather.</think>\n\n" + XML_CALL,
                                       ChatParsing(True, True, "qwen3_coder", TOOLS_BY_NAME))
    assert thought_then_call["reasoning_content"] == "Need weather."
    assert thought_then_call["content"] is None and len(thought_then_call["tool_calls"]) == 1


# ---- through the server ------------------------------------------------------

class Replies:
    """A backend that answers every request with `reply` (or the first of `queue`), one
    token per output, and records what it was given."""

    max_model_len, max_logprobs = 4096, 5

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.reply = "ok"
        self.requests = []  # (prompt ids, SamplingParams)

    async def add(self, request_id, prompt_token_ids, params, *, on_output=None):
        self.requests.append((list(prompt_token_ids), params))
        ids = self.tok.encode(self.reply, add_special_tokens=False)[:params.max_tokens]
        finish = "stop" if len(ids) < params.max_tokens else "length"
        return _Stream(request_id, list(prompt_token_ids), ids, finish, on_output)

    async def abort(self, request_id):
        pass

    def stats(self):
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
                "state_slot_usage": 0.0, "num_preemptions": 0, "serving_compiles": 0}

    def check_health(self):
        pass

    def shutdown(self):
        pass


class _Stream:
    def __init__(self, request_id, prompt, ids, finish, on_output):
        self.args = request_id, prompt, ids, finish, on_output

    async def __aiter__(self):
        request_id, prompt, ids, finish, on_output = self.args
        for i in range(len(ids)):
            await asyncio.sleep(0)
            done = i == len(ids) - 1
            out = RequestOutput(request_id, prompt, ids[:i + 1], [ids[i]], done,
                                finish_reason=finish if done else None)
            if on_output is not None:
                on_output(out)
            yield out

    async def aclose(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN_TOKENIZER)


def _serve(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tok):
    """name -> (backend, base url) of servers with the parser flags of that name."""
    options = {
        "coder": ServerOptions(reasoning_parser="qwen3", tool_call_parser="qwen3_coder",
                             auto_tool_choice=True),
        "hermes": ServerOptions(tool_call_parser="hermes", auto_tool_choice=True),
        "plain": ServerOptions(sampling_defaults={"temperature": 0.0, "top_k": 20}),
    }
    running = {}
    for name, opts in options.items():
        backend = Replies(tok)
        server, thread, url = _serve(build_app(backend, tok, "tiny", options=opts))
        running[name] = (backend, url, server, thread)
    yield {name: r[:2] for name, r in running.items()}
    for _, _, server, thread in running.values():
        server.should_exit = True
        thread.join(timeout=10)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def test_a_tool_call_reply_through_the_openai_client(served, tok):
    backend, url = served["coder"]
    backend.reply = XML_CALL
    r = client(url).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == XML_ARGS
    prompt = tok.hf.decode(backend.requests[-1][0])
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the template got them

    stream = client(url).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                                 stream=True)
    calls, reasons, content = [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert content == "" and reasons[-1] == "tool_calls"
    (call,) = calls
    assert call.index == 0 and json.loads(call.function.arguments) == XML_ARGS


def test_the_hermes_parser_through_the_client(served):
    backend, url = served["hermes"]
    backend.reply = "Checking. " + JSON_CALL
    r = client(url).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    m = r.choices[0].message
    assert m.content == "Checking. " and m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_tool_calls_and_results_in_the_history_reach_the_template(served, tok):
    backend, url = served["coder"]
    backend.reply = "It is sunny."
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(XML_ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    r = client(url).chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    prompt = tok.hf.decode(backend.requests[-1][0])
    assert ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
            in prompt)
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt


def test_thinking_goes_to_reasoning_content(served, tok):
    backend, url = served["coder"]
    backend.reply = "Two and two.\n</think>\n\nFour."
    kw = dict(model="tiny", messages=[{"role": "user", "content": "2+2?"}],
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    m = client(url).chat.completions.create(**kw).choices[0].message
    assert tok.hf.decode(backend.requests[-1][0]).endswith("<|im_start|>assistant\n<think>\n")
    assert m.content == "Four." and m.model_extra["reasoning_content"] == "Two and two.\n"
    reasoning = content = ""
    for chunk in client(url).chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += c.delta.model_extra.get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("Two and two.\n", "Four.")
    # thinking off: the template closes the block, and the reply is all content
    backend.reply = "Four."
    kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    m = client(url).chat.completions.create(**kw).choices[0].message
    assert tok.hf.decode(backend.requests[-1][0]).endswith("<think>\n\n</think>\n\n")
    assert m.content == "Four." and m.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize("name, body, param", [
    ("plain", {"tools": [WEATHER]}, "tool_choice"),  # auto needs the parser flags
    ("coder", {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ("coder", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                    "function": {"name": "get_weather"}}},
     "tool_choice"),
    ("coder", {"tool_choice": "auto"}, "tool_choice"),
    ("coder", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("coder", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ("coder", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("coder", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages"),
    ("coder", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400(served, name, body, param):
    _, url = served[name]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "\ud800"}}}]},  # a schema is any JSON object
    {"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
        "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]}]},  # JSON-escaped
])
def test_a_lone_surrogate_that_reaches_the_template_is_400(served, body):
    """Text fields refuse lone surrogates where they arrive; a tool's schema or a call's
    JSON-escaped arguments reach the prompt only through the template, whose output is
    checked too (unchecked, the tokenizer raised and the server answered 500)."""
    _, url = served["coder"]
    r = httpx.post(url + "/v1/chat/completions", headers={"content-type": "application/json"},
                   content=json.dumps({"messages": ASK, **body}))  # ASCII: the surrogate escaped
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "U+D800" in r.json()["error"]["message"]


def test_tools_the_template_cannot_render_are_400(tok, tmp_path):
    from qwen35_jax import builtin
    plain = Tokenizer(builtin.resolve("tiny-math"))  # its template knows no tools
    server, thread, url = _serve(build_app(Replies(plain), plain, "tiny-math",
                                           options=ServerOptions(tool_call_parser="hermes",
                                                               auto_tool_choice=True)))
    try:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
        assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_checkpoints_sampling_defaults_fill_unset_fields(served):
    backend, url = served["plain"]
    client(url).chat.completions.create(model="tiny", messages=ASK)
    params = backend.requests[-1][1]
    assert params.temperature == 0.0 and params.top_k == 20
    client(url).completions.create(model="tiny", prompt="x", temperature=0.7, top_p=0.5)
    params = backend.requests[-1][1]
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.5, 20)


def test_tokenize_detokenize_version_ping(served, tok):
    _, url = served["coder"]
    r = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == Replies.max_model_len
    r = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()
    assert tok.hf.decode(r["tokens"]) == tok.chat_text(ASK, [WEATHER])
    r = httpx.post(url + "/detokenize", json={"tokens": tok.encode("a cat")})
    assert r.json() == {"prompt": "a cat"}
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={"prompt": 5}).status_code == 400
    assert httpx.get(url + "/version").json()["version"]
    assert httpx.get(url + "/ping").status_code == 200 == httpx.post(url + "/ping").status_code


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": 1}]}, "messages"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "messages": []}, "messages"),  # messages make it the chat form
])
def test_a_bad_tokenize_body_is_named_by_its_field(served, body, param):
    """/tokenize takes a prompt or messages; a bad body is read as the form it claims, so
    the error names its field, not the other form's missing one."""
    _, url = served["plain"]
    r = httpx.post(url + "/tokenize", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_continuous_usage_stats(served):
    backend, url = served["plain"]
    backend.reply = "one two three four"
    n = len(backend.tok.encode(backend.reply, add_special_tokens=False))
    chunks = list(client(url).chat.completions.create(
        model="tiny", messages=ASK, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == n and len(counts) >= n
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices
    plain = list(client(url).chat.completions.create(model="tiny", messages=ASK, stream=True))
    assert all(c.usage is None for c in plain)


def test_stream_interval_sends_a_choice_n_tokens_at_a_time(tok):
    """--stream-interval 4: a choice's first token leaves at once, then four at a time,
    and whatever is left with its end; the text is the same."""
    backend = Replies(tok)
    backend.reply = "one two three four five six seven eight nine ten eleven twelve"
    n = len(tok.encode(backend.reply, add_special_tokens=False))
    server, thread, url = _serve(build_app(backend, tok, "tiny",
                                           options=ServerOptions(stream_interval=4)))
    try:
        chunks = list(client(url).completions.create(
            model="tiny", prompt="count", max_tokens=100, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    sizes = [b - a for a, b in zip([0] + counts, counts)]
    assert sizes == [1] + [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else [])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == backend.reply


def test_every_sampling_field_reaches_the_backend(served):
    """What a request sets is what the engine is given, for completions and chats alike
    (a server that dropped top_k or min_p would pass a test that only sees a 200)."""
    backend, url = served["coder"]
    backend.reply = "ok"
    common = dict(temperature=0.7, top_p=0.8, seed=3, stop=["zz"],
                  extra_body={"top_k": 5, "min_p": 0.1, "stop_token_ids": [7],
                              "ignore_eos": True, "include_stop_str_in_output": True})
    client(url).completions.create(model="tiny", prompt="x", max_tokens=9, logprobs=2, **common)
    client(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=9,
                                        logprobs=True, top_logprobs=2, **common)
    for _, p in backend.requests[-2:]:
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
            9, 0.7, 0.8, 5, 0.1, 3)
        assert (p.stop, p.stop_token_ids, p.ignore_eos, p.include_stop_str_in_output,
                p.logprobs) == (["zz"], [7], True, True, 2)


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    """--generation-config auto reads the checkpoint's sampling fields (the ones the engine
    has: repetition_penalty is not among them), vllm none, DIR that directory's; values a
    request could not have are refused at start-up."""
    from serving.api.server import server_options
    from serving.flags import server_parser

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
         "eos_token_id": [1]}))

    def options(*flags):
        return server_options(server_parser().parse_args(["--model", str(tmp_path), *flags]),
                              str(tmp_path))

    assert options().sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert options("--generation-config", "vllm").sampling_defaults == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(SystemExit, match="top_p"):
        options("--generation-config", str(other))
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        options("--enable-auto-tool-choice")


def test_a_body_over_the_limit_is_a_413_whether_its_length_is_declared_or_not(tok):
    """Refused by its Content-Length at once, or, sent in chunks without one, as soon as
    what arrived passes the limit: 413 in OpenAI's error shape either way."""
    server, thread, url = _serve(build_app(Replies(tok), tok, "tiny", max_request_bytes=4096))
    body = json.dumps({"prompt": "a " * 4096, "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    try:
        declared = httpx.post(url + "/v1/completions", content=body, headers=headers)
        chunked = httpx.post(url + "/v1/completions", headers=headers,
                             content=iter([body[:1000], body[1000:]]))
        fits = httpx.post(url + "/v1/completions", headers=headers,
                          content=iter([b'{"prompt": "x",', b' "max_tokens": 1}']))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert "content-length" not in chunked.request.headers
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    assert fits.status_code == 200, fits.text

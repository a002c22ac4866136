"""Pieces of the server that need no model: the built-in tokenizer, streaming
detokenization, and the AsyncEngine adapter over a scripted stand-in engine
(aborts, overload, bad requests, a crashing engine)."""

import asyncio
import filecmp
import json
import threading
import time
from types import SimpleNamespace

import pytest

from serving.api.text import BUILTIN_TOKENIZER, IncrementalDecoder, Tokenizer
from serving.assets import make_tiny_tokenizer
from serving.async_engine import AsyncEngine, EngineDead, EngineOverloaded, EngineStalled
from serving.engine import RequestOutput, SamplingParams

# ---- the built-in tokenizer -------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN_TOKENIZER)


def test_builtin_tokenizer_is_reproducible(tmp_path):
    make_tiny_tokenizer.main(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / name, f"{BUILTIN_TOKENIZER}/{name}", shallow=False), name


def test_builtin_tokenizer(tok):
    assert tok.vocab_size == 512
    assert [tok.hf.convert_tokens_to_ids(s) for s in
            ("<|endoftext|>", "<|im_end|>", "<|im_start|>")] == [0, 1, 2]
    assert tok.hf.eos_token_id == 1
    text = "Héllo, wörld ☃ 😀 42"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.chat_prompt([{"role": "user", "content": "hi"}])
    assert tok.hf.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids + [1]) == "user\nhi\nassistant\n"  # special tokens skipped


def test_partial_character_tokens_are_named_by_their_bytes(tok):
    """Tokens that are only part of a UTF-8 character all decode to U+FFFD alone; in
    logprobs each is named by its bytes (OpenAI's convention) so they stay distinct."""
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.hf.decode([i])]
    assert len(partial) > 1
    names = [tok.token_str(i) for i in partial]
    assert all(n.startswith("bytes:\\x") for n in names) and len(set(names)) == len(names)
    snowman = "\u2603".encode()  # three bytes; joined, the tokens' bytes are the character
    ids = tok.encode("\u2603", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == snowman
    assert tok.token_str(tok.encode("hello", add_special_tokens=False)[0])[:1] == "h"


def test_incremental_decoder_splits_characters(tok):
    text = "a☃b😀c"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # some characters take several byte tokens
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([t]) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_decoder_holds_back_for_stop_strings(tok):
    dec = IncrementalDecoder(tok, holdback=2)
    out = "".join(dec.push([t]) for t in tok.encode("hello world"))
    assert out == "hello wor"
    assert out + dec.finish("hello wo") == "hello wor"  # never takes text back
    dec = IncrementalDecoder(tok, holdback=2)
    out = "".join(dec.push([t]) for t in tok.encode("hello world"))
    assert out + dec.finish("hello world") == "hello world"


# ---- AsyncEngine over a scripted engine ---------------------------------------

class ScriptedEngine:
    """The Engine methods AsyncEngine uses. Each step (2 ms) gives every
    running request one token (its count so far); `crash_on` makes step() raise."""

    def __init__(self, crash_on: str | None = None):
        self.config = SimpleNamespace(max_model_len=64, max_logprobs=2, num_blocks=4,
                                      num_slots=4)
        self.running: dict[str, list] = {}
        self.waiting: list = []
        self.crash_on = crash_on
        self.idle_steps = 0
        self.gate = threading.Event()  # step() waits for it
        self.gate.set()
        self.in_step = threading.Event()

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise ValueError("empty prompt")
        self.waiting.append((request_id, prompt, params))
        return request_id

    def abort(self, request_id):
        if self.running.pop(request_id, None) is None:
            return None
        return self._out(request_id, [], [], "abort")

    def has_unfinished(self):
        return bool(self.running or self.waiting)

    has_steps = has_unfinished  # no transfers here

    def step(self):
        self.in_step.set()
        self.gate.wait()
        time.sleep(0.002)  # like a device step: a long request outlives the caller's reaction
        if not self.has_unfinished():
            self.idle_steps += 1
            return []
        free = 4 - len(self.running)
        admit, self.waiting = self.waiting[:free], self.waiting[free:]
        for rid, prompt, params in admit:
            self.running[rid] = [params, []]
        outs = []
        for rid, (params, tokens) in list(self.running.items()):
            if rid == self.crash_on:
                raise RuntimeError("device lost")
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            if done:
                del self.running[rid]
            outs.append(self._out(rid, tokens, [tokens[-1]], "length" if done else None))
        return outs

    def metrics(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "free_blocks": 4 - len(self.running), "free_slots": 4 - len(self.running),
                "kv_cache_usage": len(self.running) / 4, "num_preemptions": 0,
                "serving_compiles": 0, "kv_bytes_in_use": 64 * len(self.running),
                "state_bytes_in_use": 8 * len(self.running), "prefix_cache_queries": 0,
                "prefix_cache_hits": 0}

    def close(self):
        pass

    @staticmethod
    def _out(rid, tokens, new, reason):
        return RequestOutput(request_id=rid, prompt_token_ids=[1], token_ids=tokens,
                             new_token_ids=new, finished=reason is not None,
                             finish_reason=reason)


def run(coro_fn, engine: ScriptedEngine, **kw):
    async def main():
        ae = AsyncEngine(engine, **kw)
        try:
            return await coro_fn(ae)
        finally:
            ae.shutdown()
    return asyncio.run(main())


def test_generate_streams_tokens_in_order():
    async def go(ae):
        outs = [o async for o in ae.generate("a", [1, 2], SamplingParams(max_tokens=5))]
        return [t for o in outs for t in o.new_token_ids], outs[-1]
    tokens, last = run(go, ScriptedEngine())
    assert tokens == [0, 1, 2, 3, 4]
    assert last.finished and last.token_ids == [0, 1, 2, 3, 4]


def test_outputs_are_detached_copies():
    """Each output keeps the tokens it had when it left (the engine's list grows on)."""
    async def go(ae):
        return [o async for o in ae.generate("a", [1], SamplingParams(max_tokens=40))]
    outs = run(go, ScriptedEngine())
    assert len(outs) > 1
    so_far = []
    for o in outs:
        so_far += o.new_token_ids
        assert o.token_ids == so_far


def test_outputs_a_slow_reader_has_not_taken_are_joined():
    """A reader that falls behind gets one output for everything that arrived since its
    last read (the latest's state, every new token), and an error after outputs comes
    after them. `on_output` (the server's request timer) still sees each output as it
    arrived."""
    from serving.async_engine import RequestStream
    engine = ScriptedEngine()
    arrived = []

    async def slow(ae):
        stream = await ae.add("a", [1], SamplingParams(max_tokens=6), on_output=arrived.append)
        for _ in range(300):  # the engine runs the whole request before the first read
            if not engine.running and not engine.waiting:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its last outputs reach this loop
        return [o async for o in stream]
    outs = run(slow, engine)
    assert [(o.new_token_ids, o.token_ids, o.finished) for o in outs] == [
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], True)]
    assert [o.new_token_ids for o in arrived] == [[0], [1], [2], [3], [4], [5]]

    async def failing():
        stream = RequestStream(None, "b")
        for n in (1, 2):
            stream._put(ScriptedEngine._out("b", list(range(n)), [n - 1], None))
        stream._put(EngineDead("device lost"))
        got = [(await stream.__anext__()).new_token_ids]
        with pytest.raises(EngineDead, match="device lost"):
            await stream.__anext__()
        return got
    assert asyncio.run(failing()) == [[0, 1]]


def test_bad_request_raises_at_add_and_others_continue():
    async def go(ae):
        with pytest.raises(ValueError, match="empty prompt"):
            await ae.add("bad", [], SamplingParams())
        return [o async for o in ae.generate("good", [1], SamplingParams(max_tokens=2))]
    assert run(go, ScriptedEngine())[-1].finish_reason == "length"


def test_closing_a_stream_aborts_it():
    """Closing aborts the request; `on_output` (the server's request timer) sees nothing after
    the close: the abort's own output does not count as a finished request."""
    engine = ScriptedEngine()
    seen = []

    async def go(ae):
        stream = await ae.add("a", [1], SamplingParams(max_tokens=1000), on_output=seen.append)
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if not engine.running and ae.stats()["num_running"] == 0:
                await asyncio.sleep(0.05)  # the abort's output reaches this loop
                return True
            await asyncio.sleep(0.01)
    assert run(go, engine)
    assert engine.idle_steps >= 1  # the idle step that lets the engine release memory
    assert seen and not any(o.finished for o in seen)


def test_abort_ends_the_stream():
    async def go(ae):
        stream = await ae.add("a", [1], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        await ae.abort("a")
        return [o async for o in stream][-1]
    assert run(go, ScriptedEngine()).finish_reason == "abort"


def test_a_caller_whose_loop_closed_leaves_the_engine_serving_others():
    """A caller's ``asyncio.run`` returns while its request still streams (a notebook
    cell that stopped early): its request is aborted (its memory back) when its next
    output finds the loop closed, and a caller on another loop is served to the end."""
    engine = ScriptedEngine()
    ae = AsyncEngine(engine)

    async def start():
        stream = await ae.add("gone", [1], SamplingParams(max_tokens=1000))
        await stream.__anext__()  # streaming; the loop closes with it unfinished

    async def serve():
        return [o async for o in ae.generate("other", [1], SamplingParams(max_tokens=40))]

    try:
        asyncio.run(start())
        outs = asyncio.run(serve())
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 40
        ae.check_health()  # the engine thread is alive
        assert "gone" not in engine.running  # aborted, not run to its 1,000 tokens
    finally:
        ae.shutdown()


def test_queue_bound():
    engine = ScriptedEngine()
    engine.gate.clear()  # the first step blocks: nothing more is admitted or run

    async def go(ae):
        queued = [asyncio.create_task(ae.add(f"r{i}", [1], SamplingParams(max_tokens=1)))
                  for i in range(3)]
        await asyncio.sleep(0)  # the three are submitted
        await asyncio.to_thread(engine.in_step.wait)
        with pytest.raises(EngineOverloaded):
            await ae.add("r3", [1], SamplingParams(max_tokens=1))
        engine.gate.set()
        for s in await asyncio.gather(*queued):
            assert [o async for o in s][-1].finished
    run(go, engine, max_queued_requests=3)


def test_engine_crash_reaches_every_caller():
    async def go(ae):
        victim = await ae.add("boom", [1], SamplingParams(max_tokens=10))
        with pytest.raises(EngineDead):
            async for _ in victim:
                pass
        with pytest.raises(EngineDead):
            ae.check_health()
        with pytest.raises(EngineDead):
            await ae.add("later", [1], SamplingParams())
    run(go, ScriptedEngine(crash_on="boom"))


def test_a_hung_engine_ends_its_requests_and_fails_health():
    """A step that never returns: past the iteration bound the watchdog ends the request
    and the health check fails; the step coming back later stops the thread."""
    engine = ScriptedEngine()
    engine.gate.clear()  # the first step hangs until the test opens the gate

    async def go(ae):
        stream = await ae.add("a", [1], SamplingParams(max_tokens=4))

        async def drain():
            async for _ in stream:
                pass
        with pytest.raises(EngineStalled, match="over the 0.3 s bound"):
            await asyncio.wait_for(drain(), 60)  # fails rather than hangs without a watchdog
        with pytest.raises(EngineDead, match="EngineStalled"):
            ae.check_health()
        with pytest.raises(EngineDead):
            await ae.add("later", [1], SamplingParams())
        engine.gate.set()
        await asyncio.to_thread(ae._thread.join, 30)
        assert not ae._thread.is_alive() and isinstance(ae.error, EngineStalled)
    run(go, engine, iteration_timeout=0.3)


# ---- the app over a failing engine ----------------------------------------------

def _ask_crashing_app(tok, requests):
    """Sends (method, path, json) in order to an app whose engine dies on the
    first step of any request; returns the responses."""
    import httpx

    from serving.api import build_app

    async def go():
        engine = AsyncEngine(ScriptedEngine(crash_on="boom"))
        add = engine.add
        engine.add = lambda request_id, prompt, params, **kw: add("boom", prompt, params, **kw)
        app = build_app(engine, tok, "m")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://test") as c:
                return [await c.request(m, path, json=body) for m, path, body in requests]
        finally:
            engine.shutdown()
    return asyncio.run(go())


def test_app_reports_a_dead_engine(tok):
    health, first, health_after, later = _ask_crashing_app(tok, [
        ("GET", "/health", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}),
        ("GET", "/health", None),
        ("POST", "/v1/completions", {"prompt": "x", "stream": True})])
    assert health.status_code == 200 and health_after.status_code == 503
    assert first.status_code == later.status_code == 500
    assert "engine stopped" in later.json()["error"]["message"]


def test_stream_reports_engine_failure_in_band(tok):
    (r,) = _ask_crashing_app(tok, [("POST", "/v1/completions", {"prompt": "x", "stream": True})])
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 500


# ---- merging a request's outputs -------------------------------------------


def test_outputs_that_arrive_while_the_server_is_busy_leave_as_one_event():
    """Three outputs of choice 0 queued before the consumer reads: one output carrying
    all three tokens (the latest's other fields); choice 1's stays apart; an error after
    outputs lets those leave first."""
    from serving.api.generate import merged

    class Stream:
        def __init__(self, outs):
            self.outs = outs

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            for o in self.outs:
                if isinstance(o, Exception):
                    raise o
                yield o

        async def aclose(self):
            pass

    def out(rid, tokens, new, finished=False):
        return RequestOutput(rid, [1], tokens, new, finished=finished,
                             finish_reason="length" if finished else None)

    async def collect(streams):
        got = []
        try:
            async for i, o in merged(streams):
                got.append((i, o.new_token_ids, o.token_ids, o.finished))
        except ValueError as e:
            got.append(str(e))
        return got

    a = Stream([out("a", [5], [5]), out("a", [5, 6], [6]), out("a", [5, 6, 7], [7], True)])
    b = Stream([out("b", [9], [9], True)])
    assert asyncio.run(collect([a, b])) == [(0, [5, 6, 7], [5, 6, 7], True),
                                            (1, [9], [9], True)]
    bad = Stream([out("c", [4], [4]), ValueError("worker failed")])
    assert asyncio.run(collect([bad])) == [(0, [4], [4], False), "worker failed"]

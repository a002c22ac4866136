"""The text a request's tokens become, as vLLM makes it: stop strings and stop token ids,
`text_offset`, running usage per choice, and streamed chat replies that add up to the
whole one. Built-in tokenizer, no model."""

import json
from types import SimpleNamespace

import pytest

from serving.api.text import BUILTIN_TOKENIZER, Tokenizer
from serving.engine import RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN_TOKENIZER)

def _stop_run(tok, text, params):
    """The engine's stop check fed ``text``'s tokens one at a time: (finish_reason,
    stop_reason, the request's text, its tokens) once it stops."""
    from serving.engine.request import Request
    from serving.engine.stop import check_stop

    req = Request("r", [5], params, seed=0)
    config = SimpleNamespace(eos_token_ids=(1,), max_model_len=4096)
    for t in tok.encode(text):
        req.output_token_ids.append(t)
        reason, stop_reason = check_stop(req, config, tok)
        if reason is not None:
            return reason, stop_reason, req.output_text, list(req.output_token_ids)
    return None, None, req.output_text, list(req.output_token_ids)


@pytest.mark.parametrize("stop, before", [("€", "Price: 5"), ("o 😀", "Price: 5€ and s"),
                                          ("。", "Price: 5€ and so 😀 on")])
def test_a_stop_string_ending_in_a_character_of_several_tokens_is_found(tok, stop, before):
    text = "Price: 5€ and so 😀 on。 and on"
    assert len(tok.encode(stop[-1])) > 1  # the character comes in byte tokens
    reason, stop_reason, out, _ = _stop_run(tok, text, SamplingParams(stop=[stop], max_tokens=64))
    assert (reason, stop_reason, out) == ("stop", stop, before)


@pytest.mark.parametrize("text, stop, include, want", [
    (" world", ["rld", " wo"], False, ("", " wo")),      # " world" is one token
    (" this is", ["is", "th"], False, (" ", "th")),
    (" world", [" world", "or"], True, (" wor", "or")),  # completes first, starts later
    (" world", ["world", "wor"], True, (" wor", "wor")),  # one a prefix of the other
])
def test_the_stop_string_that_completes_first_wins(tok, text, stop, include, want):
    """Several stop strings completing in one token: the cut is where text arriving a
    character at a time would have stopped, whatever their order in ``stop``."""
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=64)
    reason, stop_reason, out, _ = _stop_run(tok, text, params)
    assert (reason, out, stop_reason) == ("stop", *want)


def test_a_character_still_coming_is_no_replacement_character(tok):
    """A stop string holding U+FFFD does not match the placeholder that decoding gives a
    character whose bytes are still coming ("€" is three byte tokens)."""
    assert len(tok.encode("€")) == 3
    for stop in ("\ufffd", "a\ufffd"):
        params = SamplingParams(stop=[stop], include_stop_str_in_output=True, max_tokens=64)
        assert _stop_run(tok, "a€b ok", params)[:3] == (None, None, "a€b ok")


def test_a_stop_token_ids_text_is_left_out_unless_asked(tok):
    """As vLLM: the token that stopped the request is not part of its text."""
    from serving.api.render import final_text

    (dot,) = tok.encode(".")
    for include, text in ((False, "Hello world"), (True, "Hello world.")):
        params = SamplingParams(stop_token_ids=[dot], include_stop_str_in_output=include,
                                max_tokens=64)
        reason, stop_reason, _, ids = _stop_run(tok, "Hello world. More text", params)
        assert (reason, stop_reason) == ("stop", dot)
        out = RequestOutput("r", [5], ids, ids[-1:], True, finish_reason=reason,
                            stop_reason=stop_reason)
        assert final_text(tok, out, SimpleNamespace(params=params)) == text


@pytest.mark.parametrize("text, stop", [("a€b c d", []), ("abcdefgh", ["xyz"])])
def test_text_offsets_are_where_each_token_starts_streamed_or_not(tok, text, stop):
    """A character of several tokens starts at each of them; text held back for a stop
    string counts; streamed offsets equal the non-streamed ones."""
    import dataclasses

    from serving.api import render
    from serving.api.prepare import Job, Prompt

    ids = tok.encode(text)
    params = SamplingParams(max_tokens=len(ids), stop=stop, logprobs=0)
    job = Job(0, Prompt([5]), params)
    outs = [RequestOutput("r", [5], ids[:k + 1], [t], k + 1 == len(ids),
                          finish_reason="length" if k + 1 == len(ids) else None,
                          logprobs=[{u: -0.5} for u in ids[:k + 1]])
            for k, t in enumerate(ids)]
    whole = render.completion_response("id", "m", [job], outs[-1:], tok, echo=False).choices[0]
    assert whole.text == text
    assert whole.logprobs.text_offset == [len(tok.decode(ids[:k]).rstrip("\ufffd"))
                                          for k in range(len(ids))]
    streamed = render.StreamRenderer(False, "id", "m", [job], tok)
    offsets = [o for out in outs for e in streamed.update(0, dataclasses.replace(out))
               for o in json.loads(e)["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole.logprobs.text_offset


def test_continuous_usage_counts_the_chunks_own_choice(tok):
    """As vLLM: with several prompts and choices, a chunk's running usage is its choice's
    prompt and tokens so far; the final usage counts each prompt once, every choice."""
    from serving.api import render
    from serving.api.prepare import Job, Prompt

    params = SamplingParams(max_tokens=3)
    prompts = [Prompt([5, 6, 7]), Prompt([8])]
    jobs = [Job(2 * p + c, prompts[p], params) for p in range(2) for c in range(2)]
    r = render.StreamRenderer(False, "id", "m", jobs, tok, include_usage=True,
                              continuous_usage=True)
    seen = []
    for k in range(3):
        for i in range(4):
            out = RequestOutput("r", prompts[i // 2].token_ids, [40 + i] * (k + 1), [40 + i],
                                k == 2, finish_reason="length" if k == 2 else None)
            for e in r.update(i, out):
                chunk = json.loads(e)
                seen.append((chunk["choices"][0]["index"], chunk["usage"]["prompt_tokens"],
                             chunk["usage"]["completion_tokens"]))
    assert seen == [(i, 3 if i < 2 else 1, k + 1) for k in range(3) for i in range(4)]
    final = json.loads(r.end()[0])["usage"]
    assert (final["prompt_tokens"], final["completion_tokens"]) == (4, 12)


_WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("reply, reasoning, tools, content", [
    (_CALL + "\n" + _CALL, False, True, None),  # whitespace between calls is no content
    ("\n" + _CALL, False, True, None),
    ("Sure.\n" + _CALL + "\n" + _CALL + " bye", False, True, "Sure.\n\n bye"),
    ("<think>hmm</think>", True, False, None),  # vLLM: no content is None, not ""
    ("<think></think>\n\nHi", True, False, "Hi"),
    ("one two  three", True, False, "one two  three"),
])
def test_a_streamed_chat_reply_adds_up_to_the_whole_one(tok, reply, reasoning, tools, content):
    from serving.api import render
    from serving.api.chat_output import ChatParsing
    from serving.api.prepare import Job, Prompt

    parsing = ChatParsing(reasoning, False, "hermes" if tools else None,
                          {"get_weather": _WEATHER} if tools else {})
    job = Job(0, Prompt([5]), SamplingParams(max_tokens=1000), parsing)
    ids = tok.encode(reply)
    outs = [RequestOutput("r", [5], ids[:k + 1], [t], k + 1 == len(ids),
                          finish_reason="stop" if k + 1 == len(ids) else None)
            for k, t in enumerate(ids)]
    whole = render.chat_response("id", "m", [job], outs[-1:], tok).choices[0].message
    assert whole.content == content
    r = render.StreamRenderer(True, "id", "m", [job], tok)
    r.start()
    got = {"content": None, "reasoning_content": None, "calls": []}
    for out in outs:
        for e in r.update(0, out):
            delta = json.loads(e)["choices"][0]["delta"]
            for key in ("content", "reasoning_content"):
                if delta.get(key) is not None:
                    got[key] = (got[key] or "") + delta[key]
            got["calls"] += [c["function"]["arguments"] for c in delta.get("tool_calls") or []]
    assert got == {"content": whole.content, "reasoning_content": whole.reasoning_content,
                   "calls": [c.function.arguments for c in whole.tool_calls]}


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_holds_back_only_what_a_stop_string_would_cut(tok, include):
    """A stop string's possible start is held back unless the stop string stays in the
    output; the streamed text adds up to the whole either way."""
    from serving.api import render
    from serving.api.prepare import Job, Prompt

    params = SamplingParams(max_tokens=64, stop=["xyz"], include_stop_str_in_output=include)
    reason, stop_reason, text, ids = _stop_run(tok, "abc xy abxyz tail", params)
    job = Job(0, Prompt([5]), params)
    r = render.StreamRenderer(False, "id", "m", [job], tok)
    sent = []
    for k, t in enumerate(ids):
        out = RequestOutput("r", [5], ids[:k + 1], [t], k + 1 == len(ids), finish_reason=reason
                            if k + 1 == len(ids) else None, stop_reason=stop_reason)
        sent.append("".join(json.loads(e)["choices"][0]["text"] for e in r.update(0, out)))
    assert "".join(sent) == text == ("abc xy abxyz" if include else "abc xy ab")
    before_last = "".join(sent[:-1])
    assert before_last == ("abc xy abxy" if include else "abc xy ab")

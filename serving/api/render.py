"""Engine outputs to OpenAI response bodies and server-sent events.

Text is made here from token ids, not taken from the backend, so a backend
never handles text: the output text skips special tokens, and a stop string
cuts it where the engine found it (the engine's `stop_reason`). A chat reply's
text is then split into reasoning, content and tool calls (chat_output.py); a
reply that calls a tool and then stops has the finish reason "tool_calls".
"""

import json
import time

from serving.api.chat_output import ChatStream, message_fields
from serving.api.prepare import Job
from serving.api.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                  ChatCompletionResponse, ChatLogprobs, ChatStreamChoice,
                                  CompletionChoice, CompletionLogprobs, CompletionResponse,
                                  DeltaMessage, PromptTokensDetails, TokenLogprob,
                                  TopLogprob, UsageInfo)
from serving.api.text import IncrementalDecoder, Tokenizer
from serving.engine import RequestOutput
from serving.engine.stop import text_token_ids

DONE = "[DONE]"  # the data of a stream's last event, as OpenAI ends it


def sse(body) -> str:
    """The data of one server-sent event (`app.EventStream` frames it)."""
    return body.model_dump_json() if hasattr(body, "model_dump_json") else json.dumps(body)


def final_text(tok: Tokenizer, out: RequestOutput, job: Job) -> str:
    text = tok.decode(text_token_ids(out.token_ids, out.finish_reason, out.stop_reason,
                                     job.params))
    if isinstance(out.stop_reason, str):
        i = text.find(out.stop_reason)
        if i >= 0:
            text = text[:i + len(out.stop_reason)] if job.params.include_stop_str_in_output \
                else text[:i]
    return text


def usage(jobs: list[Job], outs: list[RequestOutput | None]) -> UsageInfo:
    """Each prompt counts once, however many choices it has (vLLM's convention), and so
    do its cached tokens (the most any of its choices found). `outs[i]` is job i's
    latest output, None if it has none."""
    prompt = sum(len(p.token_ids) for p in {id(j.prompt): j.prompt for j in jobs}.values())
    completion = sum(len(o.token_ids) for o in outs if o is not None)
    cached: dict[int, int] = {}
    for j, o in zip(jobs, outs, strict=True):
        if o is not None:
            cached[id(j.prompt)] = max(cached.get(id(j.prompt), 0), o.num_cached_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


class TextOffsets:
    """OpenAI's ``text_offset``: where each token's text starts in a choice's text, from
    ``start`` (after an echoed prompt). It is the length of the text the earlier tokens
    decode to, so a character of several tokens starts at each of them, and held-back
    text (stop strings) counts as it does in the non-streamed answer."""

    def __init__(self, tok: Tokenizer, start: int):
        self._dec, self._pos = IncrementalDecoder(tok), start

    def of(self, token_ids: list[int]) -> list[int]:
        """The offsets of the choice's next tokens (every token passes here once)."""
        out = []
        for t in token_ids:
            out.append(self._pos)
            self._pos += len(self._dec.push([t]))
        return out


def completion_logprobs(tok: Tokenizer, token_ids: list[int], lps: list[dict[int, float]],
                        offsets: list[int]) -> CompletionLogprobs:
    """``offsets``: where each token's text starts in the choice's text (TextOffsets)."""
    res = CompletionLogprobs()
    for t, top, offset in zip(token_ids, lps, offsets):
        s = tok.token_str(t)
        res.tokens.append(s)
        res.token_logprobs.append(top.get(t))
        res.top_logprobs.append({tok.token_str(k): v for k, v in top.items()})
        res.text_offset.append(offset)
    return res


def chat_logprobs(tok: Tokenizer, token_ids: list[int], lps: list[dict[int, float]],
                  num_top: int) -> ChatLogprobs:
    def entry(t, v):
        s = tok.token_str(t)
        raw = tok.token_bytes(t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode() if raw is None else raw))

    content = []
    for t, top in zip(token_ids, lps):
        best = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(TokenLogprob(**entry(t, top[t]).model_dump(),
                                    top_logprobs=[entry(k, v) for k, v in best]))
    return ChatLogprobs(content=content)


def completion_response(request_id: str, model: str, jobs: list[Job], outs: list[RequestOutput],
                        tok: Tokenizer, echo: bool) -> CompletionResponse:
    choices = []
    for job, out in zip(jobs, outs):
        prefix = _echo_text(tok, job) if echo else ""
        lp = None
        if out.logprobs is not None:
            lp = completion_logprobs(tok, out.token_ids, out.logprobs,
                                     TextOffsets(tok, len(prefix)).of(out.token_ids))
        choices.append(CompletionChoice(index=job.index, text=prefix + final_text(tok, out, job),
                                        logprobs=lp, finish_reason=out.finish_reason,
                                        stop_reason=out.stop_reason))
    return CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=usage(jobs, outs))


def _finish_reason(out: RequestOutput, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and out.finish_reason == "stop" else out.finish_reason


def chat_response(request_id: str, model: str, jobs: list[Job], outs: list[RequestOutput],
                  tok: Tokenizer) -> ChatCompletionResponse:
    choices = []
    for job, out in zip(jobs, outs):
        lp = None
        if out.logprobs is not None:
            lp = chat_logprobs(tok, out.token_ids, out.logprobs, job.params.logprobs)
        message = AssistantMessage(**message_fields(final_text(tok, out, job), job.parsing))
        choices.append(ChatChoice(index=job.index, message=message, logprobs=lp,
                                  finish_reason=_finish_reason(out, bool(message.tool_calls)),
                                  stop_reason=out.stop_reason))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(jobs, outs))


def _holdback(job: Job) -> int:
    """Characters that may be the start of a stop string, held back until the next
    token shows whether it ends there; none when the stop string stays in the output
    (the text up to its end is the reply's either way)."""
    if job.params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in job.params.stop), default=1) - 1


def _echo_text(tok: Tokenizer, job: Job) -> str:
    p = job.prompt
    return p.text if p.text is not None else tok.decode(p.token_ids)


class StreamRenderer:
    """The events of one streamed response, choice by choice as outputs arrive:
    text deltas (held back near possible stop strings; in a chat, split into
    reasoning, content and whole tool calls), logprobs of the new tokens, the
    finish reason, then usage if asked (with `continuous_usage`, in every event
    too), then `[DONE]`."""

    def __init__(self, chat: bool, request_id: str, model: str, jobs: list[Job],
                 tok: Tokenizer, *, echo: bool = False, include_usage: bool = False,
                 continuous_usage: bool = False):
        self.chat, self.id, self.model, self.jobs, self.tok = chat, request_id, model, jobs, tok
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.created = int(time.time())
        self.decoders = [IncrementalDecoder(tok, _holdback(j)) for j in jobs]
        self.prefix = [_echo_text(tok, j) if echo else "" for j in jobs]
        self.offsets = [TextOffsets(tok, len(p)) for p in self.prefix]
        self.finals: list[RequestOutput | None] = [None] * len(jobs)
        self.latest: list[RequestOutput | None] = [None] * len(jobs)
        self.texts = [""] * len(jobs)  # each choice's text sent so far
        self.chats = [ChatStream(j.parsing) for j in jobs]
        self.called_tools = [False] * len(jobs)

    def start(self) -> list[str]:
        if not self.chat:
            return []
        return [self._chat_chunk(i, ChatStreamChoice(index=j.index, delta=DeltaMessage(
            role="assistant", content=""))) for i, j in enumerate(self.jobs)]

    def update(self, i: int, out: RequestOutput) -> list[str]:
        job, dec = self.jobs[i], self.decoders[i]
        new = out.new_token_ids
        self.latest[i] = out
        if out.finished:  # the final text, not the new tokens: they may run past a stop string
            self.finals[i] = out
            text = self.prefix[i] + dec.finish(final_text(self.tok, out, job))
        else:
            text = self.prefix[i] + dec.push(new)
        self.prefix[i] = ""
        lps = out.logprobs[len(out.logprobs) - len(new):] if out.logprobs is not None else None
        if self.chat:
            if job.parsing.plain:  # no parser: the text goes out as content, kept nowhere
                delta = DeltaMessage(content=text) if text else None
            else:
                self.texts[i] += text
                delta = self.chats[i].update(self.texts[i], out.finished)
            if delta is not None and delta.tool_calls:
                self.called_tools[i] = True
            if not (delta or out.finished or lps):
                return []
            return [self._chat_choice(i, delta or DeltaMessage(), new, lps, out)]
        if not (text or out.finished or lps):
            return []
        return [self._completion_choice(i, text, new, lps, out)]

    def end(self) -> list[str]:
        events = []
        if self.include_usage:
            u = usage(self.jobs, self.finals)
            if self.chat:
                events.append(sse(ChatCompletionChunk(id=self.id, created=self.created,
                                                      model=self.model, choices=[], usage=u)))
            else:
                events.append(sse(CompletionResponse(id=self.id, created=self.created,
                                                     model=self.model, choices=[], usage=u)))
        return events + [DONE]

    def _chat_choice(self, i, delta: DeltaMessage, new, lps, out) -> str:
        job = self.jobs[i]
        lp = chat_logprobs(self.tok, new, lps, job.params.logprobs) if lps else None
        return self._chat_chunk(i, ChatStreamChoice(
            index=job.index, delta=delta, logprobs=lp,
            finish_reason=_finish_reason(out, self.called_tools[i]) if out.finished else None,
            stop_reason=out.stop_reason if out.finished else None))

    def _completion_choice(self, i, text, new, lps, out) -> str:
        job = self.jobs[i]
        lp = None
        if lps is not None:
            lp = completion_logprobs(self.tok, new, lps, self.offsets[i].of(new)) if lps else None
        return sse(CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=self._running_usage(i),
            choices=[CompletionChoice(index=job.index, text=text, logprobs=lp,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      stop_reason=out.stop_reason if out.finished else None)]))

    def _running_usage(self, i: int) -> UsageInfo | None:
        """``continuous_usage_stats``: the chunk's own choice, its prompt and its tokens so
        far (vLLM's convention; the final usage sums every choice)."""
        return usage(self.jobs[i:i + 1], self.latest[i:i + 1]) if self.continuous_usage else None

    def _chat_chunk(self, i: int, choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                       choices=[choice], usage=self._running_usage(i)))

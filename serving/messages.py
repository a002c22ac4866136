"""The messages between the router and the workers, as typed models that both sides use:
the sender builds one and serialises it, the receiver validates the bytes back into the
same model. So a field cannot change type on the way (the logprob dicts' int keys,
strings in JSON, come back as ints) and a worker refuses a malformed or forged body with
a message naming the field (400) before any of it reaches its engine.

    router ── PrefillRequest ──▶ prefill worker ── PrefillResult ──▶ router
    router ── GET /outputs ──▶ decode worker ── DecodeOutputs per line (NDJSON) ──▶ router
    router ── DecodeRequest ──▶ decode worker  (its frames come on the named channel)
    router ── DecodeAbort ──▶ decode worker    (the caller went away)
    router ── Sources ──▶ decode worker          (the prefill workers it may pull from)
    router ── PeerLost ──▶ prefill worker        (a decode worker that died)
    router ── Abandon ──▶ prefill worker         (no decode worker will pull this request)

Connections idle out at the router first (``ROUTER_IDLE_SECONDS``, its pool's keep-alive
expiry), the workers much later (``WORKER_IDLE_SECONDS``): were the worker first, a
request the router sends on a connection the worker is closing meets a closed socket.

Token ids are checked against the model's vocabulary by the engine, which knows it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from serving.engine import RequestOutput, SamplingParams
from serving.engine.config import MAX_SPECULATIVE_TOKENS
from serving.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from transfer import Ticket
from transfer.lease import ID as LEASE_ID

ROUTER_IDLE_SECONDS = 5.0  # the router's pool closes a connection idle this long
WORKER_IDLE_SECONDS = 60  # a worker closes one idle this long, long after the router

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Logprobs = list[dict[int, float]]  # per token: token id -> logprob (the chosen one included)


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Sampling(Message):
    """``SamplingParams`` on the wire, with the engine's ranges as field limits."""

    max_tokens: int = Field(16, ge=1, lt=2**31)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(0, ge=-1, lt=2**31)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, lt=2**31)

    @classmethod
    def of(cls, params: SamplingParams) -> "Sampling":
        return cls(**dataclasses.asdict(params))

    def params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())


class PrefillRequest(Message):
    request_id: RequestId
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    params: Sampling


class PrefillResult(Message):
    """The first token and, if the request goes on, the ticket of its pinned cache."""

    token_ids: list[TokenId]
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    transfer: Ticket | None = None
    num_cached_tokens: Annotated[int, Field(ge=0, lt=2**31)] = 0  # prefix-cache hit
    queue_seconds: Annotated[float, Field(ge=0)] = 0.0  # waiting before its prefill began
    # speculative decoding: the MTP head's drafts after the first token
    draft_token_ids: list[TokenId] = Field(default_factory=list,
                                          max_length=MAX_SPECULATIVE_TOKENS)


ChannelId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]


class DecodeRequest(Message):
    request_id: RequestId
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    first_token: TokenId
    params: Sampling
    transfer: Ticket
    channel: ChannelId  # the output channel (GET /outputs) that carries its frames
    draft_token_ids: list[TokenId] = Field(default_factory=list,
                                          max_length=MAX_SPECULATIVE_TOKENS)  # to verify first


class DecodeAbort(Message):
    """The router's caller went away: abort the request (a no-op once it has ended)."""

    request_id: RequestId
    channel: ChannelId


class DecodeFrame(Message):
    """A request's outputs new since its last frame: tokens (with their logprobs when
    asked), or ``error`` ending the request."""

    request_id: RequestId
    new_token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: Logprobs | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> "DecodeFrame":
        new = list(out.new_token_ids)
        return cls(request_id=out.request_id, new_token_ids=new, finished=out.finished,
                   finish_reason=out.finish_reason,
                   stop_reason=out.stop_reason, num_preemptions=out.num_preemptions,
                   logprobs=out.logprobs[len(out.logprobs) - len(new):]
                   if out.logprobs is not None else None)


class DecodeOutputs(Message):
    """One NDJSON line of a decode worker's output channel: the frames of the channel's
    requests with outputs since the last line, in order (one line per engine step, not
    one per request); the first line names the channel; a line with neither keeps an idle
    channel open."""

    channel: ChannelId | None = None
    frames: list[DecodeFrame] = Field(default_factory=list)


class Sources(Message):
    """The handshake addresses of the prefill workers a decode worker may pull from."""

    addresses: list[tuple[Annotated[str, Field(min_length=1, max_length=255)],
                          Annotated[int, Field(ge=1, le=65535)]]] = Field(max_length=4096)


class PeerLost(Message):
    """A decode worker's transfer agent that is gone: a prefill worker frees its leases."""

    agent: Annotated[str, Field(min_length=1, max_length=200)]


class Abandon(Message):
    """No decode worker will pull the request under ``lease`` (the router gave it up before
    one accepted it): the prefill worker frees the lease now unless an agent claimed it."""

    lease: Annotated[str, Field(max_length=64, pattern=f"^{LEASE_ID.pattern}$")]

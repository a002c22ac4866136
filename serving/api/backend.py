"""What the HTTP server needs from whatever generates tokens.

The server is written against this interface only, so the same app fronts the
aggregated engine (`serving.async_engine.AsyncEngine`) or a router over
disaggregated prefill/decode workers. Token ids in, `RequestOutput`s out:
tokenization, chat templates, detokenization and the OpenAI shapes stay in
the server, so a backend never handles text.
"""

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from serving.engine import RequestOutput, SamplingParams
from serving.errors import EngineDead, EngineOverloaded, Unavailable

__all__ = ["Backend", "EngineDead", "EngineOverloaded", "RequestStream", "Unavailable"]


class RequestStream(Protocol):
    """Outputs of one request, in order, ending with one whose `finished` is set."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it is still running."""


class Backend(Protocol):
    max_model_len: int  # prompt plus output tokens
    max_logprobs: int  # the largest `logprobs` a request may ask for

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  *, on_output: Callable[[RequestOutput], None] | None = None
                  ) -> RequestStream:
        """Returns once the request is accepted. Raises ValueError for a
        request it cannot serve, EngineOverloaded when its queue is full,
        Unavailable when no worker it needs is live now, EngineDead when it
        can serve nothing.

        `on_output(out)` runs on the server's loop for each output, never after the stream
        is closed: the server's latency histograms count each step's tokens apart. The
        engine's stream calls it as an output arrives, before joining it to a backlog its
        reader has not taken; the router's as its reader takes each (never joined) frame."""

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict:
        """Counters for /metrics: num_running, num_waiting, kv_cache_usage,
        state_slot_usage, num_preemptions, serving_compiles; optionally
        transfers, transfer_bytes, transfer_seconds, transfer_ack_seconds (cumulative)."""

    def check_health(self) -> None:
        """Raises EngineDead when requests can no longer be served."""

    def shutdown(self) -> None: ...

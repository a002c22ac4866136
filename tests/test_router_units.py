"""The router without worker processes (tests/test_disagg.py runs the real ones)."""
import asyncio

import pytest

from serving.engine import RequestOutput
from serving.router import Router, RouterStream


class _Response:
    """Stands in for the decode worker's streaming HTTP response."""

    def __init__(self):
        self.closed = False

    async def aclose(self):
        self.closed = True


def test_stream_closed_before_iteration_closes_its_decode_request():
    """A request whose sibling choice failed is closed unread: its decode stream must
    still be closed (so the worker aborts it) and its load dropped."""
    router = Router(["http://p"], ["http://d"], max_model_len=64, max_logprobs=0)
    router.decode.load["http://d"] += 1  # as _start_decode counts a started decode
    first = RequestOutput("r", [1, 2], [3], [3], finished=False)
    response = _Response()
    stream = RouterStream(router, "r", first, ("http://d", response))
    asyncio.run(stream.aclose())
    asyncio.run(stream.aclose())  # twice: no second decrement
    assert response.closed and router.decode.load["http://d"] == 0


def _router_with(decode_status, decode_detail):
    """A router whose workers are an httpx mock: the prefill worker answers with a first
    token and transfer params, the decode worker with `decode_status`."""
    import httpx

    def handler(request):
        if request.url.path == "/prefill":
            return httpx.Response(200, json={
                "token_ids": [7], "logprobs": None, "finish_reason": None,
                "stop_reason": None, "transfer": {"agent": "a", "lease": "l", "items": []}})
        return httpx.Response(decode_status, json={"detail": decode_detail})

    router = Router(["http://p"], ["http://d"], max_model_len=64, max_logprobs=0,
                    decode_retry_seconds=0.0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router._ensure_polling = lambda: None
    return router


def test_a_decode_refusal_of_an_accepted_request_is_a_worker_failure():
    """The prefill worker accepted the request, so a decode worker's 400 (say, stale
    params after a prefill restart) is the system's fault: WorkerFailed, not the
    client's ValueError (HTTP 400); its load is dropped."""
    from serving.async_engine import EngineOverloaded
    from serving.engine import SamplingParams
    from serving.router import WorkerFailed

    for status, kind in ((400, WorkerFailed), (503, EngineOverloaded)):
        router = _router_with(status, "transfer params refused: stale params")
        with pytest.raises(kind, match="stale params"):
            asyncio.run(router.add("r", [1, 2, 3], SamplingParams(max_tokens=4)))
        assert router.decode.load["http://d"] == 0

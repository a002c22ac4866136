"""The router's stream object, without workers (tests/test_disagg.py runs the real ones)."""
import asyncio

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

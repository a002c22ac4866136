"""The router without worker processes (tests/test_disagg.py runs the real ones)."""
import asyncio
import json

import pytest

from serving.engine import RequestOutput, SamplingParams
from serving.errors import EngineOverloaded, Unavailable, WorkerFailed
from serving.messages import DecodeFrame
from serving.output_channel import OutputChannel
from serving.router import Router, RouterStream
from serving.worker_pool import WorkerPool

SECRET = "the workers' shared secret, test"
TICKET = {"agent": "prefill-a", "address": ["127.0.0.1", 9000], "lease": "abc.1", "ttl": 30.0}


class _Channels:
    """The mock decode workers' output channels: ``GET /outputs`` streams the frames that
    ``/decode`` posts give it (``frame``, with the request's id)."""

    def __init__(self, frame: dict):
        self.frame, self.queues = frame, {}

    def outputs(self):
        import httpx

        channel = f"{len(self.queues) + 1:x}"
        queue = self.queues[channel] = asyncio.Queue()

        async def lines():
            yield (json.dumps({"channel": channel}) + "\n").encode()
            while True:
                frame = await queue.get()
                yield (json.dumps({"frames": [frame]}) + "\n").encode()

        return httpx.Response(200, content=lines())

    def decode(self, request):
        import httpx

        body = json.loads(request.content)
        self.queues[body["channel"]].put_nowait({**self.frame, "request_id": body["request_id"]})
        return httpx.Response(200, json={"ok": True})


def test_stream_closed_before_iteration_aborts_its_decode_request():
    """A request whose sibling choice failed is closed unread: the worker is told to abort
    it, it leaves the channel, and its load is dropped, once."""
    import httpx

    posted = []

    def handler(request):
        posted.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"aborted": True})

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router.decode.load["http://d"] += 1  # as _start_decode counts a started decode
    channel = OutputChannel(router._client, "http://d")
    channel._id = "c1"
    queue = channel.register("r")
    first = RequestOutput("r", [1, 2], [3], [3], finished=False)
    stream = RouterStream(router, "r", first, ("http://d", channel, queue), None)

    async def close_twice():
        await stream.aclose()
        await stream.aclose()  # no second decrement or abort
        await asyncio.gather(*router._notices)

    asyncio.run(close_twice())
    assert posted == [("/abort", {"request_id": "r", "channel": "c1"})]
    assert router.decode.load["http://d"] == 0 and "r" not in channel._queues


def test_a_router_stream_shows_each_output_to_on_output_once():
    """The first token, then each decode frame, reach `on_output` as the reader takes them;
    a stream closed before it is read shows nothing."""
    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    channel = OutputChannel(router._client, "http://d")
    first = RequestOutput("r", [1, 2], [3], [3], finished=False)
    seen = []
    queue = channel.register("r")
    for new, done in (([4], False), ([5, 6], True)):
        queue.put_nowait(DecodeFrame(request_id="r", new_token_ids=new, finished=done,
                                     finish_reason="length" if done else None))
    router.decode.load["http://d"] += 1
    stream = RouterStream(router, "r", first, ("http://d", channel, queue), seen.append)

    async def read():
        return [out.token_ids async for out in stream]

    assert asyncio.run(read()) == [[3], [3, 4], [3, 4, 5, 6]]
    assert [(o.new_token_ids, o.finished) for o in seen] == [([3], False), ([4], False),
                                                              ([5, 6], True)]
    unread = []
    asyncio.run(RouterStream(router, "u", first, None, unread.append).aclose())
    assert unread == []


def _router_with(decode_status, decode_detail):
    """A router whose workers are an httpx mock: the prefill worker answers with a first
    token and transfer params, the decode worker with `decode_status`."""
    import httpx

    def handler(request):
        if request.url.path == "/prefill":
            return httpx.Response(200, json={
                "token_ids": [7], "logprobs": None, "finish_reason": None,
                "stop_reason": None, "transfer": TICKET})
        if request.url.path == "/sources":
            return httpx.Response(200, json={"ok": True})
        if request.url.path == "/outputs":
            return channels.outputs()
        return httpx.Response(decode_status, json={"detail": decode_detail})

    channels = _Channels({})

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0,
                    decode_retry_seconds=0.0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler), headers=router._client.headers)
    router._ensure_polling = lambda: None
    return router


def test_a_decode_refusal_of_an_accepted_request_is_a_worker_failure():
    """The prefill worker accepted the request, so a decode worker's 400 (say, stale
    params after a prefill restart) is the system's fault: WorkerFailed, not the
    client's ValueError (HTTP 400); its load is dropped."""
    for status, kind in ((400, WorkerFailed), (503, EngineOverloaded)):
        router = _router_with(status, "transfer params refused: stale params")
        with pytest.raises(kind, match="stale params"):
            asyncio.run(router.add("r", [1, 2, 3], SamplingParams(max_tokens=4)))
        assert router.decode.load["http://d"] == 0


def _two_of_each(dead: str | None):
    """Two prefill and two decode workers behind an httpx mock; the worker `dead` (None:
    none) answers as one whose engine thread has stopped (503 with engine_dead, /stats
    too). Returns the router and the per-URL call counts."""
    import collections

    import httpx

    calls = collections.Counter()

    def handler(request):
        url = f"http://{request.url.host}"
        calls[url, request.url.path] += 1
        assert request.headers["authorization"] == f"Bearer {SECRET}"
        if url == dead:
            return httpx.Response(503, json={"detail": "engine stopped: boom",
                                             "engine_dead": True})
        if request.url.path == "/stats":
            return httpx.Response(200, json=STATS[url[7]])
        if request.url.path in ("/sources", "/peer_lost"):
            calls[url, request.url.path, request.content] += 1
            return httpx.Response(200, json={"ok": True})
        if request.url.path == "/prefill":
            return httpx.Response(200, json={
                "token_ids": [7], "logprobs": [{"7": -0.25}], "finish_reason": None,
                "stop_reason": None, "transfer": TICKET})
        if request.url.path == "/outputs":
            return channels.outputs()
        return channels.decode(request)

    channels = _Channels({"new_token_ids": [8], "finished": True, "finish_reason": "length",
                          "stop_reason": None, "logprobs": [{"8": -0.5, "3": -1.5}]})

    router = Router(["http://p0", "http://p1"], ["http://d0", "http://d1"],
                    secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler), headers=router._client.headers)
    router._ensure_polling = lambda: None
    return router, calls


STATS = {"p": {"agent": "prefill-a", "transfer_address": ["127.0.0.1", 9000]},
         "d": {"agent": "decode-a", "transfer_address": ["127.0.0.1", 9100]}}


async def _serve(router, n):
    """n requests one after another; the exception or the tokens of each."""
    out = []
    for i in range(n):
        try:
            stream = await router.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2))
            out.append([o.token_ids async for o in stream][-1])
        except Exception as e:  # noqa: BLE001 -- the test inspects it
            out.append(e)
    return out


def test_a_prefill_worker_whose_engine_died_is_no_longer_picked():
    """Its 503 says the engine stopped (not that it is full): the request that met it
    fails as WorkerFailed, the worker is marked down, and the next requests all go to
    the live one. A health poll finds it down too."""
    router, calls = _two_of_each(dead="http://p0")
    out = asyncio.run(_serve(router, 6))
    failed = [o for o in out if isinstance(o, Exception)]
    assert len(failed) <= 1 and all(isinstance(e, WorkerFailed) for e in failed)
    assert out[-5:] == [[7, 8]] * 5
    assert calls["http://p0", "/prefill"] <= 1 and "http://p0" in router._down()
    router._health["http://p0"] = None  # forget it; the poll must find it again
    asyncio.run(router.poll_workers())
    assert router._down() == {"http://p0"}


def test_a_decode_worker_whose_engine_died_is_passed_over():
    """A request that meets it goes on to the live decode worker at once (no retries
    for the retry window, no failure), and later requests skip it."""
    router, calls = _two_of_each(dead="http://d0")
    out = asyncio.run(_serve(router, 6))
    assert out == [[7, 8]] * 6
    assert calls["http://d0", "/decode"] <= 1 and "http://d0" in router._down()
    assert router.decode.load == {"http://d0": 0, "http://d1": 0}


def test_no_live_decode_worker_fails_the_request():
    """With every decode worker's engine stopped the request fails as Unavailable (503), not
    as an overloaded server retried for the whole retry window."""
    router, calls = _two_of_each(dead="http://d0")
    router.decode.urls.remove("http://d1")
    del router.decode.load["http://d1"]
    [err] = asyncio.run(_serve(router, 1))
    assert isinstance(err, Unavailable) and "engine stopped" in str(err)
    # now that the router knows it is down, the next request is refused before its prefill
    prefills = calls["http://p0", "/prefill"] + calls["http://p1", "/prefill"]
    [err] = asyncio.run(_serve(router, 1))
    assert isinstance(err, Unavailable) and "no decode worker is live" in str(err)
    assert calls["http://p0", "/prefill"] + calls["http://p1", "/prefill"] == prefills


def test_a_decode_worker_that_refuses_connections_is_passed_over():
    """A refused connection never reached the worker, so the request goes on to the other
    decode worker; with none left a request is refused at once (Unavailable, 503). Loads
    return to zero."""
    import httpx

    router, calls = _two_of_each(dead=None)
    handler = router._client._transport.handler

    def refusing(request):
        if request.url.host == "d0":
            raise httpx.ConnectError("connection refused", request=request)
        return handler(request)

    router._client = httpx.AsyncClient(transport=httpx.MockTransport(refusing), headers=router._client.headers)
    assert asyncio.run(_serve(router, 3)) == [[7, 8]] * 3
    assert "http://d0" in router._down() and router.decode.load == {"http://d0": 0, "http://d1": 0}
    router.decode.urls.remove("http://d1")
    del router.decode.load["http://d1"]
    [err] = asyncio.run(_serve(router, 1))  # known to be gone: refused before its prefill
    assert isinstance(err, Unavailable) and "connection refused" in str(err)


def test_a_cancelled_decode_start_drops_its_load():
    """The caller going away while the decode worker has not answered yet must not leave
    the worker counted as busier."""
    import httpx

    router, _ = _two_of_each(dead=None)
    handler = router._client._transport.handler

    async def slow(request):
        if request.url.path == "/decode":
            await asyncio.sleep(10)
        return handler(request)

    router._client = httpx.AsyncClient(transport=httpx.MockTransport(slow), headers=router._client.headers)

    async def main():
        task = asyncio.create_task(router.add("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert router.decode.load == {"http://d0": 0, "http://d1": 0}


def test_the_least_loaded_worker_is_picked():
    router = Router(["http://p0", "http://p1", "http://p2"], ["http://d"], secret=SECRET,
                    max_model_len=64, max_logprobs=0)
    router.prefill.load.update({"http://p0": 3, "http://p1": 1, "http://p2": 2})
    assert {router.prefill.pick() for _ in range(6)} == {"http://p1"}
    assert router.prefill.pick(exclude={"http://p1"}) == "http://p2"
    assert router.prefill.pick(exclude=set(router.prefill.urls)) is None


def test_a_prompt_goes_where_its_prefix_went_unless_that_worker_is_busier():
    """Cost = outstanding requests + the share of the prompt's blocks a worker was not
    sent: with equal loads the longest match wins; load outweighs a partial match; a
    prompt sharing nothing goes by load alone."""
    pool = WorkerPool(["http://a", "http://b", "http://c"], block_size=4)
    head = list(range(1, 17))  # four blocks
    pool.prefixes.record(pool.prefixes.keys(head + [99]), "http://b")
    pool.prefixes.record(pool.prefixes.keys(head[:8]), "http://c")
    keys = pool.prefixes.keys(head + [5, 6, 7, 8])  # five blocks
    assert pool.prefixes.matched(keys) == {"http://b": 4, "http://c": 2}
    assert {pool.pick(keys=keys) for _ in range(6)} == {"http://b"}  # 0.2 < 0.6 < 1
    pool.load["http://b"] = 1
    assert {pool.pick(keys=keys) for _ in range(6)} == {"http://c"}  # 1.2 > 0.6 < 1
    assert pool.pick(keys=keys, exclude={"http://c"}) == "http://a"  # 1.2 > 1
    other = pool.prefixes.keys(list(range(100, 120)))
    pool.load.update({"http://a": 1, "http://b": 2, "http://c": 1})
    assert {pool.pick(keys=other) for _ in range(6)} == {"http://a", "http://c"}


def test_logprobs_keep_their_int_token_ids_through_the_router():
    """The decode frames are typed: token ids keyed as JSON strings come back as ints."""
    router, _ = _two_of_each(dead=None)

    async def go():
        stream = await router.add("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
        return [o async for o in stream][-1]

    out = asyncio.run(go())
    assert out.logprobs == [{7: -0.25}, {8: -0.5, 3: -1.5}]


def test_decode_workers_are_given_the_prefill_sources_first_and_again_after_a_restart():
    """A decode worker pulls only from sources the router registered: they are posted
    before its first request, not again while they hold, and again once it restarted
    (its agent changed)."""
    router, calls = _two_of_each(dead=None)
    asyncio.run(_serve(router, 4))
    posted = {k: v for k, v in calls.items() if len(k) == 3 and k[1] == "/sources"}
    assert set(posted.values()) == {1} and {k[0] for k in posted} <= {"http://d0", "http://d1"}
    assert all(b'"127.0.0.1",9000' in k[2] for k in posted)
    d0 = {**STATS["d"], "agent": "decode-restarted"}
    router._saw("http://d0", d0)
    router._registered.pop("http://d1", None)
    asyncio.run(_serve(router, 4))
    again = {k: v for k, v in calls.items() if len(k) == 3 and k[1] == "/sources"}
    assert sum(again.values()) > sum(posted.values())


def test_a_decode_worker_that_refuses_connections_has_its_leases_freed():
    """A refused connection means the process is gone: the prefill workers are told to
    free the leases its agent claimed."""
    import httpx

    router, calls = _two_of_each(dead=None)
    router._saw("http://d0", STATS["d"])
    handler = router._client._transport.handler

    def refusing(request):
        if request.url.host == "d0" and request.url.path != "/sources":
            raise httpx.ConnectError("connection refused", request=request)
        return handler(request)

    router._client = httpx.AsyncClient(transport=httpx.MockTransport(refusing), headers=router._client.headers)

    async def go():
        await router.poll_workers()
        await asyncio.sleep(0.1)  # the notices go out as tasks

    asyncio.run(go())
    lost = {k for k in calls if len(k) == 3 and k[1] == "/peer_lost"}
    assert {k[0] for k in lost} == {"http://p0", "http://p1"}
    assert all(b'"decode-a"' in k[2] for k in lost) and "http://d0" in router._down()


@pytest.mark.parametrize("failure", ["read_error", "full", "cancelled"])
def test_a_request_no_decode_worker_took_has_its_lease_abandoned(failure):
    """Prefilled, but no decode worker took it (the connection broke mid-request, every
    worker stayed full, or the caller went away): the prefill worker is told to free the
    lease now rather than hold the memory to its expiry; a worker the request may have
    reached is told to abort it."""
    import httpx

    posted = []
    channels = _Channels({})

    async def handler(request):
        path = request.url.path
        if path == "/prefill":
            return httpx.Response(200, json={"token_ids": [7], "transfer": TICKET})
        if path == "/outputs":
            return channels.outputs()
        if path == "/sources":
            return httpx.Response(200, json={"ok": True})
        posted.append((request.url.host, path, json.loads(request.content)))
        if path != "/decode":
            return httpx.Response(200, json={"ok": True})
        if failure == "read_error":
            raise httpx.ReadError("", request=request)
        if failure == "cancelled":
            await asyncio.sleep(10)
        return httpx.Response(503, json={"detail": "full"})

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64,
                    max_logprobs=0, decode_retry_seconds=0.0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                       headers=router._client.headers)
    router._ensure_polling = lambda: None

    async def main():
        task = asyncio.create_task(router.add("r", [1, 2, 3], SamplingParams(max_tokens=4)))
        if failure == "cancelled":
            await asyncio.sleep(0.2)
            task.cancel()
        with pytest.raises({"read_error": WorkerFailed, "full": EngineOverloaded,
                            "cancelled": asyncio.CancelledError}[failure]):
            await task
        await asyncio.gather(*router._notices)

    asyncio.run(main())
    notices = [(host, path, body) for host, path, body in posted if path != "/decode"]
    expected = [("p", "/abandon", {"lease": TICKET["lease"]})]
    if failure in ("read_error", "cancelled"):  # the worker may have the request
        expected.insert(0, ("d", "/abort", {"request_id": "r", "channel": "1"}))
    assert sorted(notices) == sorted(expected) and router.decode.load["http://d"] == 0


def test_the_router_closes_idle_connections_before_a_worker_does():
    """A worker closing an idle connection while the router sends on it is a request lost
    to a closed socket (httpx ReadError): the router's pool expires idle connections
    first, well before the workers' keep-alive."""
    from serving.messages import ROUTER_IDLE_SECONDS, WORKER_IDLE_SECONDS

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    assert router._client._transport._pool._keepalive_expiry == ROUTER_IDLE_SECONDS
    assert WORKER_IDLE_SECONDS >= 2 * ROUTER_IDLE_SECONDS


def test_a_request_the_wire_refuses_leaves_no_load_behind():
    """Params the workers' wire format refuses (a max_tokens past int32) are a 400 before
    anything is posted, and the prefill worker's load, which picks the next worker, is
    what it was."""
    import httpx
    from pydantic import ValidationError

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: pytest.fail(f"posted {request.url.path}")))
    router._ensure_polling = lambda: None

    async def go():
        for _ in range(3):
            with pytest.raises(ValidationError, match="max_tokens"):
                await router.add("r", [5, 6], SamplingParams(max_tokens=2**31))

    asyncio.run(go())
    assert router.prefill.load["http://p"] == 0

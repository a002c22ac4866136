"""A decode worker's output channel, at both ends without worker processes: the worker
batches its requests' frames a line per wake-up (serving/worker/channels.py), and the
router hands each frame to its request and fails them all when the channel breaks
(serving/output_channel.py). tests/test_disagg.py runs the real processes."""

import asyncio
import json

import pytest

from serving.engine import RequestOutput, SamplingParams
from serving.errors import WorkerFailed
from serving.router import Router
from test_router_units import SECRET, TICKET


class _Stream:
    """An engine output stream of `outs`, then (unless `finish`) one that never ends."""

    def __init__(self, outs, finish=True):
        self.outs, self.finish, self.closed = list(outs), finish, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for out in self.outs:
            yield out
        if not self.finish:
            await asyncio.Event().wait()

    async def aclose(self):
        self.closed = True


def _out(request_id, tokens, finished=False):
    return RequestOutput(request_id, [1], tokens, tokens, finished=finished,
                         finish_reason="length" if finished else None)


def test_an_output_channel_batches_its_requests_frames_and_aborts_on_close():
    """Frames of the requests on one channel come in one line per wake-up, each under its
    request id, only after the request's transfer is confirmed; an abort cancels one
    request (its engine stream is closed, which aborts it), and a channel that closes
    aborts the rest."""
    from serving.messages import DecodeOutputs
    from serving.worker.channels import Channels

    async def go():
        channels = Channels(keepalive=0.05)
        channel = channels.open()
        lines = channel.lines()
        assert DecodeOutputs.model_validate_json(await anext(lines)).channel == channel.id
        loop = asyncio.get_running_loop()
        confirmed = {r: loop.create_future() for r in ("a", "b", "c")}
        streams = {"a": _Stream([_out("a", [5]), _out("a", [6], True)]),
                   "b": _Stream([_out("b", [7])], finish=False),
                   "c": _Stream([_out("c", [9])], finish=False)}
        for r, s in streams.items():
            channel.start(r, s, confirmed[r])
        assert await anext(lines) == "\n"  # nothing before a confirmation: a keepalive
        for f in confirmed.values():
            f.set_result(None)
        frames, n_lines = [], 0
        while len(frames) < 4:
            line = await anext(lines)
            frames += DecodeOutputs.model_validate_json(line).frames if line.strip() else []
            n_lines += 1
        assert n_lines == 1  # the frames of one wake-up travel together
        assert [(f.request_id, f.new_token_ids) for f in frames] == \
            [("a", [5]), ("a", [6]), ("b", [7]), ("c", [9])]
        assert channel.abort("b") and not channel.abort("a")  # "a" has ended
        await asyncio.sleep(0.01)
        assert streams["b"].closed and not streams["c"].closed
        await lines.aclose()  # the router went away
        await asyncio.sleep(0.01)
        assert streams["c"].closed and channel.closed
        with pytest.raises(ValueError, match="no open output channel"):
            channels.get(channel.id)

    asyncio.run(go())


def test_an_abort_that_comes_before_its_request_starts_aborts_it_as_it_starts():
    """The router gave up while the worker was still admitting the request (its /abort
    overtook its /decode): the request is aborted when it starts, and sends nothing."""
    from serving.worker.channels import Channels

    async def go():
        channel = Channels(keepalive=0.05).open()
        assert not channel.abort("late")  # not running here yet
        stream = _Stream([_out("late", [5])], finish=False)
        confirmed = asyncio.get_running_loop().create_future()
        confirmed.set_result(None)
        channel.start("late", stream, confirmed)
        await asyncio.sleep(0.01)
        assert stream.closed and channel._frames.empty()
        other = _Stream([_out("late", [6])], finish=False)  # the id is free again
        channel.start("late", other, confirmed)
        await asyncio.sleep(0.01)
        assert not other.closed and not channel._frames.empty()
        channel.close()

    asyncio.run(go())


def test_one_output_channel_carries_every_request_and_its_break_fails_them():
    """Two requests on one decode worker share one output channel, each getting its own
    frames from a line that carries both; when the channel breaks, both fail as
    WorkerFailed (not hang), their loads drop, and the next request opens a new
    channel."""
    import httpx

    opened, posted = [], []

    def handler(request):
        if request.url.path == "/prefill":
            body = json.loads(request.content)
            return httpx.Response(200, json={"token_ids": [body["prompt_token_ids"][0]],
                                             "transfer": TICKET})
        if request.url.path == "/sources":
            return httpx.Response(200, json={"ok": True})
        if request.url.path == "/outputs":
            channel = f"{len(opened) + 1:x}"
            opened.append(asyncio.Queue())
            queue = opened[-1]

            async def lines():
                yield (json.dumps({"channel": channel}) + "\n").encode()
                while (line := await queue.get()) is not None:
                    yield line
                raise httpx.ReadError("connection reset")

            return httpx.Response(200, content=lines())
        if request.url.path == "/decode":
            posted.append(json.loads(request.content))
            return httpx.Response(200, json={"ok": True})
        return httpx.Response(200, json={"aborted": False})

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router._ensure_polling = lambda: None

    async def collect(stream, into):
        try:
            async for out in stream:
                into.append(out.token_ids)
        except WorkerFailed as e:
            into.append(e)

    async def go():
        a = await router.add("a", [1, 9], SamplingParams(max_tokens=4))
        b = await router.add("b", [2, 9], SamplingParams(max_tokens=4))
        assert [p["channel"] for p in posted] == ["1", "1"] and len(opened) == 1
        got = {"a": [], "b": []}
        tasks = [asyncio.create_task(collect(s, got[s.request_id])) for s in (a, b)]
        frames = [{"request_id": r, "new_token_ids": [t]} for r, t in (("b", 20), ("a", 10))]
        opened[0].put_nowait((json.dumps({"frames": frames}) + "\n").encode())
        await asyncio.sleep(0.05)
        assert got == {"a": [[1], [1, 10]], "b": [[2], [2, 20]]}
        opened[0].put_nowait(None)  # the channel breaks
        await asyncio.gather(*tasks)
        assert all(isinstance(got[r][-1], WorkerFailed) for r in "ab"), got
        assert "failed mid-request" in str(got["a"][-1])
        assert router.decode.load["http://d"] == 0
        await router.add("c", [3, 9], SamplingParams(max_tokens=4))
        assert posted[-1]["channel"] == "2" and len(opened) == 2

    asyncio.run(go())


def test_an_output_no_frame_can_carry_ends_its_request_with_an_error_frame():
    """An output the frame refuses (a NaN logprob, from a step gone wrong) ends its
    request with an error frame and aborts it, rather than leaving the router waiting on
    a request that sends nothing more; the channel carries the others on."""
    from serving.messages import DecodeOutputs
    from serving.worker.channels import Channels

    async def go():
        channel = Channels(keepalive=0.05).open()
        lines = channel.lines()
        await anext(lines)
        confirmed = asyncio.get_running_loop().create_future()
        confirmed.set_result(None)
        bad = _out("bad", [5])
        bad.logprobs = [{5: float("nan")}]
        streams = {"bad": _Stream([bad], finish=False), "ok": _Stream([_out("ok", [6])], finish=False)}
        for r, s in streams.items():
            channel.start(r, s, confirmed)
        frames = []

        async def two_frames():
            while len(frames) < 2:
                line = await anext(lines)
                frames.extend(DecodeOutputs.model_validate_json(line).frames if line.strip() else [])

        await asyncio.wait_for(two_frames(), 2)  # a request left open would never end
        by_id = {f.request_id: f for f in frames}
        assert by_id["bad"].finished and "ValidationError" in by_id["bad"].error
        assert by_id["ok"].new_token_ids == [6] and by_id["ok"].error is None
        assert streams["bad"].closed and not streams["ok"].closed and not channel.closed
        channel.close()

    asyncio.run(go())


def test_a_channel_that_ends_before_its_first_line_fails_the_request_as_the_workers():
    """A decode worker whose /outputs ends before it names the channel: the request fails
    as the worker's failure (WorkerFailed, a 502 at the API), not as the router's own."""
    import httpx

    def handler(request):
        if request.url.path == "/prefill":
            return httpx.Response(200, json={"token_ids": [5], "transfer": TICKET})
        if request.url.path == "/outputs":
            return httpx.Response(200, content=b"")
        return httpx.Response(200, json={"ok": True})

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router._ensure_polling = lambda: None

    async def go():
        with pytest.raises(WorkerFailed, match="closed its output channel"):
            await router.add("r1", [5, 6, 7], SamplingParams(max_tokens=4))
        assert router.decode.load["http://d"] == 0

    asyncio.run(go())


def test_a_lost_abort_is_sent_again_while_the_requests_frames_still_come(monkeypatch):
    """The caller left and the router's /abort was lost: the worker goes on sending the
    request's frames, so the router tells it again a grace later, and stops at the
    request's finished ("abort") frame."""
    import httpx

    from serving import output_channel

    monkeypatch.setattr(output_channel, "STRAY_GRACE", 0.05)
    lines, aborts = asyncio.Queue(), []

    def handler(request):
        if request.url.path == "/prefill":
            return httpx.Response(200, json={"token_ids": [1], "transfer": TICKET})
        if request.url.path == "/outputs":
            async def body():
                yield (json.dumps({"channel": "1"}) + "\n").encode()
                while (line := await lines.get()) is not None:
                    yield line
            return httpx.Response(200, content=body())
        if request.url.path == "/abort":
            aborts.append(json.loads(request.content))  # and lost: the worker goes on
            return httpx.Response(200, json={"aborted": False})
        return httpx.Response(200, json={"ok": True})

    def frame(**kw):
        return (json.dumps({"frames": [{"request_id": "a", **kw}]}) + "\n").encode()

    router = Router(["http://p"], ["http://d"], secret=SECRET, max_model_len=64, max_logprobs=0)
    router._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router._ensure_polling = lambda: None

    async def go():
        stream = await router.add("a", [1, 9], SamplingParams(max_tokens=40))
        await stream.aclose()  # the caller left
        for _ in range(4):  # frames a grace apart: the abort is sent again for each
            lines.put_nowait(frame(new_token_ids=[7]))
            await asyncio.sleep(0.08)
        lines.put_nowait(frame(finished=True, finish_reason="abort"))
        lines.put_nowait(frame(new_token_ids=[7]))  # after the end the grace starts afresh
        await asyncio.sleep(0.05)
        assert [a["request_id"] for a in aborts] == ["a"] * 4, aborts
        assert all(a["channel"] == "1" for a in aborts)
        lines.put_nowait(None)

    asyncio.run(go())


def test_an_aborted_request_ends_with_an_abort_frame():
    from serving.worker.channels import Channels

    async def go():
        channel = Channels(keepalive=0.05).open()
        confirmed = asyncio.get_running_loop().create_future()
        confirmed.set_result(None)
        channel.start("b", _Stream([_out("b", [7])], finish=False), confirmed)
        await asyncio.sleep(0.01)
        assert channel.abort("b")
        await asyncio.sleep(0.01)
        frames = [channel._frames.get_nowait() for _ in range(channel._frames.qsize())]
        assert [(f.new_token_ids, f.finished, f.finish_reason) for f in frames] == \
            [([7], False, None), ([], True, "abort")]
        channel.close()

    asyncio.run(go())

"""Running the engine requests of one HTTP request: submit them all (or none),
merge their outputs into one ordered stream, and abort whatever is left when
the client goes away or anything fails.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request

from serving.api.backend import Backend, EngineDead, EngineOverloaded, RequestStream, Unavailable
from serving.errors import WorkerFailed
from serving.api.errors import APIError
from serving.api.metrics import Metrics, RequestTimer
from serving.api.prepare import Job
from serving.engine import RequestOutput
from serving.engine.outputs import joined


async def submit(backend: Backend, request_id: str, jobs: list[Job],
                 timers: list[RequestTimer]) -> list[RequestStream]:
    """Add every job, its timer seeing each of its outputs apart, or abort those already
    added and raise the first failure as an APIError (400 bad input, 503 overload or no
    live worker, 502 a worker that failed, 500 dead engine)."""
    results = await asyncio.gather(
        *(backend.add(f"{request_id}-{j.index}", j.prompt.token_ids, j.params,
                      on_output=t.output) for j, t in zip(jobs, timers, strict=True)),
        return_exceptions=True)
    streams = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return streams
    await close_all(streams)
    e = errors[0]
    if isinstance(e, EngineOverloaded):
        raise APIError(f"server overloaded: {e}", status=503) from e
    if isinstance(e, Unavailable):
        raise APIError(f"service unavailable: {e}", status=503) from e
    if isinstance(e, WorkerFailed):
        raise APIError(f"a worker failed: {e}", status=502) from e
    if isinstance(e, EngineDead):
        raise APIError(str(e), status=500) from e
    if isinstance(e, ValueError):
        raise APIError(str(e)) from e
    raise e


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(position in `streams`, output) as outputs arrive, until all finish. Outputs
    of a stream that arrive while the consumer is busy are joined into one (as vLLM's
    output collector joins them): a server that falls behind its engine sends fewer,
    larger events instead of a backlog of one-token events, and each token still
    leaves at the first chance. Closing the iterator early aborts the unfinished
    requests (callers close the streams themselves too, in case the iterator never
    started)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            latest: dict[int, RequestOutput] = {}
            error = None
            for i, out in arrived:
                if isinstance(out, Exception):
                    error = out
                    break
                if out.finished:
                    remaining -= 1
                latest[i] = joined(latest[i], out) if i in latest else out
            for i, out in latest.items():
                yield i, out
            if isinstance(error, EngineDead):
                raise APIError(str(error), status=500) from error
            if error is not None:
                raise error
    finally:
        for t in tasks:
            t.cancel()
        await close_all(streams)


async def every(outputs: AsyncIterator[tuple[int, RequestOutput]], interval: int
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs` with each choice's tokens gathered `interval` at a time
    (``--stream-interval``): a choice's first output and its last pass at once, the
    others wait until they hold `interval` new tokens between them."""
    pending: dict[int, RequestOutput] = {}
    started: set[int] = set()
    async for i, out in outputs:
        held = pending.pop(i, None)
        if held is not None:
            out = joined(held, out)
        if out.finished or i not in started or len(out.new_token_ids) >= interval:
            started.add(i)
            yield i, out
        else:
            pending[i] = out


async def close_all(streams: list[RequestStream]) -> None:
    """Abort whichever of `streams` has not finished (closing twice is harmless)."""
    for s in streams:
        await s.aclose()


def start_timers(metrics: Metrics, jobs: list[Job], start: float) -> list[RequestTimer]:
    return [metrics.request(len(j.prompt.token_ids), start) for j in jobs]


async def until_disconnect(request: Request, work):
    """Await `work` unless the client disconnects first; then cancel it (which
    aborts its engine requests) and return None. For non-streaming answers:
    a streamed answer notices the disconnect when Starlette cancels it."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

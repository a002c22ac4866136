"""The router's end of a decode worker's output channel (``serving.worker.channels``).

One long-lived ``GET /outputs`` stream per decode worker carries every request's frames
there, a line per engine step; a reader task validates each line once and hands each
frame to its request's queue. A request's queue is registered before its ``/decode`` is
posted, so no frame can come before it. When the stream ends, breaks or sends a malformed
line, every request on the channel ends with ``WorkerFailed`` and the next request opens
a new channel.

Frames of a request the router no longer follows (its caller left, and the router sent
the worker an abort) are strays. They stop at the worker's "abort" frame; a request that
still sends them ``STRAY_GRACE`` seconds later has not heard the abort (the call was
lost), and it is sent again, once a grace, until the request's finished frame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from serving.errors import WorkerFailed
from serving.messages import DecodeOutputs


STRAY_GRACE = 1.0  # seconds of frames after its abort before a request is told again


class OutputChannel:
    def __init__(self, client: httpx.AsyncClient, url: str,
                 on_stray: Callable[[str, str], None] = lambda request_id, channel: None):
        """``on_stray(request_id, channel id)``: tell the worker again to abort a request
        whose frames still come (the router's ``_abort``)."""
        self._client, self.url, self._on_stray = client, url, on_stray
        self._queues: dict[str, asyncio.Queue] = {}
        self._strays: dict[str, float] = {}  # request id -> when its abort is due again
        self._id: str | None = None
        self._reader: asyncio.Task | None = None
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    @property
    def id(self) -> str | None:
        """The open channel's id; None while none is open."""
        return self._id

    async def open(self) -> str | httpx.Response:
        """The channel's id, opening the stream first if it is not open; the worker's
        answer (read) if it refused. Raises what the HTTP call raises, or WorkerFailed
        for a malformed first line."""
        loop = asyncio.get_running_loop()
        if self._opening is None or self._opening[0] is not loop:
            self._opening = (loop, asyncio.Lock())
        async with self._opening[1]:
            if self._id is not None:
                return self._id
            request = self._client.build_request("GET", f"{self.url}/outputs")
            response = await self._client.send(request, stream=True)
            try:
                if response.status_code != 200:
                    await response.aread()
                    await response.aclose()
                    return response
                lines = response.aiter_lines()
                first = await anext(lines, None)
                if first is None:
                    raise WorkerFailed(f"decode worker {self.url} closed its output channel "
                                       f"before naming it")
                channel = DecodeOutputs.model_validate_json(first).channel
                if channel is None:
                    raise WorkerFailed(f"decode worker {self.url} named no output channel")
            except ValidationError as e:
                await response.aclose()
                raise WorkerFailed(f"decode worker {self.url} sent a malformed line: {e}") from None
            except BaseException:
                await response.aclose()
                raise
            self._id = channel
            self._reader = asyncio.get_running_loop().create_task(self._read(response, lines))
            return channel

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue that receives `request_id`'s frames (then, if the channel fails, the
        WorkerFailed that ended it)."""
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self, response: httpx.Response, lines) -> None:
        error = WorkerFailed(f"decode worker {self.url} closed its output channel")
        try:
            async for line in lines:
                if not line:
                    continue  # keepalive
                try:
                    batch = DecodeOutputs.model_validate_json(line)
                except ValidationError as e:
                    error = WorkerFailed(f"decode worker {self.url} sent a malformed frame: {e}")
                    return
                for frame in batch.frames:
                    queue = self._queues.get(frame.request_id)
                    if queue is not None:
                        queue.put_nowait(frame)
                    else:
                        self._stray(frame)
        except (httpx.TransportError, httpx.StreamError) as e:
            error = WorkerFailed(f"decode worker {self.url} failed mid-request: {e!r}")
        finally:
            self._id = None
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()
            self._strays.clear()  # the worker aborts a closed channel's requests
            await response.aclose()

    def _stray(self, frame) -> None:
        """A frame of a request unregistered here: its abort is sent again once it has
        had ``STRAY_GRACE`` seconds to land, and again a grace later, until the request's
        finished frame."""
        if frame.finished:
            self._strays.pop(frame.request_id, None)
            return
        now = time.monotonic()
        due = self._strays.setdefault(frame.request_id, now + STRAY_GRACE)
        if now >= due:
            self._strays[frame.request_id] = now + STRAY_GRACE
            self._on_stray(frame.request_id, self._id)

    def close(self) -> None:
        """Stop reading (the router is shutting down); the worker then aborts the
        channel's requests."""
        if self._reader is not None:
            self._reader.cancel()

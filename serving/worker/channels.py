"""A decode worker's output channels: how its requests' tokens reach the router.

The router opens one channel per decode worker (``GET /outputs``, an NDJSON stream) and
names it in every ``/decode`` it posts there. Each line (``DecodeOutputs``) carries the
frames of all the channel's requests that have new outputs, so the router reads and
validates one line per engine step rather than one per request and token: with one HTTP
stream per request, the router's event loop spent ~300 µs per streamed token and fell
behind its decode worker at 16 streams on two CPU cores (bench/RESULTS.md, "Streamed
tokens in bursts").

A request's frames are pumped into its channel only once its transfer is confirmed
(``DecodeWorker.decode``); a failed transfer or a stopped engine ends it with an error
frame. ``abort`` (the router's caller went away) and a channel that closes (the router
went away) abort the requests through their engine streams, which frees their memory.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets

from serving.errors import EngineDead, TransferFailed
from serving.messages import DecodeFrame, DecodeOutputs

KEEPALIVE_SECONDS = 5.0  # an idle channel sends an empty line this often
EARLY_ABORTS = 4096  # aborts of requests not started yet, remembered per channel

log = logging.getLogger("serving.worker")


class Channel:
    def __init__(self, keepalive: float = KEEPALIVE_SECONDS, on_close=lambda channel: None):
        self.id = secrets.token_hex(8)
        self.keepalive, self._on_close = keepalive, on_close
        self.closed = False
        self._frames: asyncio.Queue[DecodeFrame] = asyncio.Queue()
        self._pumps: dict[str, asyncio.Task] = {}
        # aborts that came before their request started (the router gave up while its
        # /decode was still being admitted): the request is aborted as it starts
        self._aborted_early: collections.OrderedDict[str, None] = collections.OrderedDict()

    def start(self, request_id: str, stream, confirmed: asyncio.Future) -> None:
        """Send `stream`'s outputs on this channel once `confirmed` resolves."""
        if request_id in self._aborted_early:
            del self._aborted_early[request_id]
            asyncio.get_running_loop().create_task(stream.aclose())  # aborts the request
            return
        if self.closed or request_id in self._pumps:
            asyncio.get_running_loop().create_task(stream.aclose())  # aborts the request
            raise ValueError(f"output channel {self.id} is closed" if self.closed
                             else f"duplicate request id {request_id}")
        task = asyncio.get_running_loop().create_task(self._pump(request_id, stream, confirmed))
        self._pumps[request_id] = task
        task.add_done_callback(lambda t: self._pumps.pop(request_id, None)
                               if self._pumps.get(request_id) is t else None)

    async def _pump(self, request_id: str, stream, confirmed: asyncio.Future) -> None:
        """Every request that starts here ends with a finished frame: an error one if
        anything stops its outputs (the router waits for it), an "abort" one if it was
        aborted (the router stops re-sending its abort: ``serving.output_channel``)."""
        error = aborted = None
        try:
            await confirmed
            async for out in stream:
                self._frames.put_nowait(DecodeFrame.of(out))
        except asyncio.CancelledError:  # `abort`, or the channel closed
            aborted = DecodeFrame(request_id=request_id, finished=True, finish_reason="abort")
        except (TransferFailed, EngineDead) as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 -- e.g. an output no frame can carry (a NaN logprob)
            log.exception("outputs of %s stopped", request_id)
            error = f"internal error: {type(e).__name__}"
        finally:
            await stream.aclose()  # a request still running is aborted
        if error is not None:
            self._frames.put_nowait(DecodeFrame(request_id=request_id, error=error, finished=True))
        elif aborted is not None:
            self._frames.put_nowait(aborted)

    def abort(self, request_id: str) -> bool:
        """Abort a request of this channel; False if it is not running here: ended, or not
        started yet, in which case it is aborted when it starts (remembered for the last
        ``EARLY_ABORTS`` such ids)."""
        task = self._pumps.get(request_id)
        if task is None:
            self._aborted_early[request_id] = None
            if len(self._aborted_early) > EARLY_ABORTS:
                self._aborted_early.popitem(last=False)
            return False
        task.cancel()
        return True

    async def lines(self):
        """The channel's NDJSON lines: its id, then the frames as they come, batched."""
        try:
            yield DecodeOutputs(channel=self.id).model_dump_json() + "\n"
            while True:
                try:
                    first = await asyncio.wait_for(self._frames.get(), self.keepalive)
                except TimeoutError:
                    yield "\n"
                    continue
                frames = [first]
                while not self._frames.empty():
                    frames.append(self._frames.get_nowait())
                yield DecodeOutputs(frames=frames).model_dump_json() + "\n"
        finally:
            self.close()

    def close(self) -> None:
        """The router went away: abort every request of the channel."""
        self.closed = True
        for task in list(self._pumps.values()):
            task.cancel()
        self._on_close(self)


class Channels:
    """The open channels of a decode worker, by id."""

    def __init__(self, keepalive: float = KEEPALIVE_SECONDS):
        self.keepalive = keepalive
        self._open: dict[str, Channel] = {}

    def open(self) -> Channel:
        channel = Channel(self.keepalive, on_close=lambda c: self._open.pop(c.id, None))
        self._open[channel.id] = channel
        return channel

    def get(self, channel_id: str) -> Channel:
        channel = self._open.get(channel_id)
        if channel is None:
            raise ValueError(f"no open output channel {channel_id}")
        return channel

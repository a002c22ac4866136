"""`AsyncEngine`: the synchronous, step-driven `Engine` behind an asyncio API.

The engine is not thread-safe and its `step()` blocks for as long as the
device step takes, so it runs on one background thread that owns it
completely. The event loop talks to that thread through a command inbox (add,
abort) and gets outputs back on its loop (`post`; a caller whose loop has closed is
gone, and the thread serves on without it); neither side ever waits on the other, so
a slow step never stalls HTTP handling and a burst of HTTP requests never stalls a
step. Commands are applied between steps.

    stream = await engine.add(request_id, prompt_token_ids, params)  # admission
    async for out in stream: ...      # RequestOutput per step, until finished

`add` returns only once the engine has accepted the request, so a caller can
answer a bad request with an error before it starts streaming. Leaving the
iteration early (a client that disconnects) aborts the request, which frees
its KV blocks and state slot. `generate` is the one-call form of the two.

Overload: requests accepted but not yet running are bounded by
`max_queued_requests`; beyond it `add` raises `EngineOverloaded` at once, so
that callers get a quick 503 instead of an unbounded wait. A caller that must
commit something before its `add` (a decode worker claims a lease only one
worker may hold) takes its place first (`reserve_room`), so that the `add`
after the commit is not refused for room.

A hung engine (a device that never finishes a step, a call that never returns) is
dead too: an iteration of the engine thread that runs past `iteration_timeout` seconds
ends every request with `EngineStalled` and fails the health check, as vLLM's engine
iteration timeout does, so no caller waits on it for ever.

This class is one implementation of `serving.api.backend.Backend`; a router
over disaggregated prefill/decode workers can implement the same interface.
"""

import asyncio
import dataclasses
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from serving.engine import Engine, RequestOutput, SamplingParams
from serving.engine.connector import EngineConnector
from serving.engine.outputs import joined
from serving.errors import EngineDead, EngineOverloaded, EngineStalled

log = logging.getLogger(__name__)

# Seconds a thread waiting for the GIL lets its holder run before it asks for a switch
# (Python's default is 5 ms). The engine thread gives the GIL up in every call that
# releases it: each host array a program call copies to the device, each dispatch, each
# wait for the sampled tokens (about 10 a decode step, counted on CPU), and must win it
# back from the event loop, which is busy streaming outputs; each return can cost about
# this much more (bench.api_pace with a stand-in engine, bench/RESULTS.md "The GIL between
# the engine thread and the server's loop"). It stays set for the process's life.
GIL_SWITCH_INTERVAL = 0.001


class RequestStream:
    """Outputs of one request, in order; async-iterable until it finishes. Outputs that
    arrive before the consumer takes the last one are joined into one (as vLLM's
    RequestOutputCollector joins them): a server loop that falls behind the engine
    then handles fewer, larger outputs instead of a growing backlog of one-token ones,
    and each token still leaves at the first chance."""

    def __init__(self, owner: "AsyncEngine", request_id: str,
                 on_output: Callable[[RequestOutput], None] | None = None):
        self.request_id = request_id
        self._on_output = on_output  # sees each output as it arrives, before any join
        self.finished = False
        self.admitted = False  # set by the engine thread once the engine took the request
        self._owner = owner
        self._pending: deque = deque()  # outputs (each joined with any after it) and errors
        self._ready = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        item = self._pending.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self.finished:
            self.finished = True
            self._owner._send(("abort", self.request_id))

    def _put(self, item) -> None:
        if self._on_output is not None and not self.finished and isinstance(item, RequestOutput):
            self._on_output(item)  # not the abort's output after the reader closed the stream
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            self._pending[-1] = joined(last, item)
        else:
            self._pending.append(item)
        self._ready.set()


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queued_requests: int = 1024,
                 connector: EngineConnector | None = None, iteration_timeout: float = 120.0):
        """`connector` (serving/engine/connector.py): how requests enter the engine, what
        runs between steps (a disaggregated worker's transfers; an idle engine ticks
        whenever `wake()` is called) and what ends when the loop stops.
        `iteration_timeout`: seconds an iteration (commands, tick, step) may run before
        the engine counts as hung; it covers a compile while serving."""
        if not iteration_timeout > 0:
            raise ValueError(f"iteration_timeout must be > 0 seconds, got {iteration_timeout!r}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.iteration_timeout = iteration_timeout
        self._busy_since: float | None = None  # the running iteration's start (engine thread)
        self.max_model_len = engine.config.max_model_len
        self.max_logprobs = engine.config.max_logprobs
        self.connector = connector or EngineConnector()
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        # Adds submitted by the loop thread minus adds applied by the engine
        # thread, plus places reserved by the loop thread: each counter has a
        # single writer, so no lock is needed.
        self._submitted = 0
        self._applied = 0
        self._reserved = 0
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._stats = self._snapshot()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    # ---- the asyncio side ------------------------------------------------

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams, *, reserved: bool = False,
                  on_cancel: Callable[[Engine], object] | None = None,
                  on_output: Callable[[RequestOutput], None] | None = None,
                  **admit) -> RequestStream:
        """Queue a request and wait until the engine accepts it (through the connector's
        `admit`, which gets the keyword arguments `admit`). Raises ValueError (bad
        request, from the engine's checks), EngineOverloaded or EngineDead.

        `reserved`: the caller holds a place from `reserve_room`, which this add takes.
        A caller cancelled while its admission is pending ends the request only if this
        admission succeeded (another request's id, refused as a duplicate, is not
        touched): the engine thread then aborts it and runs `on_cancel(engine)`.
        `on_output`: as `serving.api.backend.Backend.add` says."""
        if reserved:
            self._reserved -= 1
            self.check_health()
        else:
            self.check_room()
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, on_output)
        admitted = loop.create_future()
        self._submitted += 1
        prompt = list(prompt_token_ids)
        self._send(("add", request_id, (prompt, params, admit), stream, admitted, loop))
        if self.error is not None:  # the thread died and may have drained the inbox already
            _settle(admitted, EngineDead(f"engine stopped: {self.error!r}"))
        try:
            await admitted
        except asyncio.CancelledError:
            stream.finished = True
            self._send(("withdraw", stream, on_cancel))
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """`add`, then the outputs; leaving the loop early aborts the request."""
        stream = await self.add(request_id, prompt_token_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def call(self, fn: Callable[[Engine], object]):
        """Run `fn(engine)` on the engine thread between steps; returns its result."""
        self.check_health()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._send(("call", fn, done, loop))
        if self.error is not None:  # the thread died and may have drained the inbox already
            _settle(done, EngineDead(f"engine stopped: {self.error!r}"))
        return await done

    def fail(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with `error` (engine thread only)."""
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            stream, loop = entry
            post(loop, stream._put, error)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        self._send(("abort", request_id))

    def check_room(self) -> None:
        """Raise EngineDead, or EngineOverloaded if `add` would find the queue full now:
        for a caller that must know before it commits anything (a decode worker, before
        it claims a lease that only one worker may hold)."""
        self.check_health()
        if self.num_queued() >= self.max_queued_requests:
            raise EngineOverloaded(f"{self.num_queued()} requests are queued "
                                   f"(max_queued_requests={self.max_queued_requests})")

    def reserve_room(self) -> None:
        """`check_room`, then hold a place in the queue for an `add(..., reserved=True)`
        to come (loop thread): for a caller that commits something between the two, so
        that its add is not refused for room after it committed. `release_room` gives
        back a place that no add took."""
        self.check_room()
        self._reserved += 1

    def release_room(self) -> None:
        self._reserved -= 1

    def num_queued(self) -> int:
        """Requests accepted but not running: reserved, in the inbox or in the engine's
        queue."""
        return self._submitted - self._applied + self._reserved + self._stats["num_waiting"]

    def stats(self) -> dict:
        """Engine counters as of the last loop iteration (see `_snapshot`)."""
        return {**self._stats, "num_waiting": self.num_queued()}

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineDead(f"engine stopped: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise EngineDead("engine thread is not running")

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.close()

    def wake(self) -> None:
        """Have the engine thread iterate (and tick) soon, even when idle; any thread."""
        self._wake.set()

    def _send(self, command: tuple) -> None:
        self._inbox.append(command)
        self._wake.set()

    # ---- the engine thread -----------------------------------------------

    def _run(self) -> None:
        drained = True
        try:
            while not self._stopping:
                self._busy_since = time.monotonic()
                self._wake.clear()  # before the tick: a wake() during it is not lost
                self._apply_commands()
                self.connector.tick(self.engine)
                self._stats = self._snapshot()
                if self.engine.has_steps():
                    self._deliver(self.engine.step())
                    drained = False
                elif not drained:
                    # One idle step applies memory releases still held back
                    # by the step fence, so the pools read full when idle.
                    self._deliver(self.engine.step())
                    drained = True
                else:
                    self._busy_since = None
                    self._wake.wait()
        except BaseException as e:  # noqa: BLE001 -- every failure must reach the callers
            log.exception("engine loop failed")
            self.error = self.error or e  # a stall, declared first, stays the cause
        else:
            self.error = self.error or EngineDead("engine shut down")
        self._busy_since = None
        stopped = EngineDead(f"engine stopped: {self.error!r}")
        self._fail_all(stopped)
        self.connector.on_stop(stopped)

    def _watch(self) -> None:
        """The watchdog's thread: declares the engine hung once an iteration has run
        past `iteration_timeout`, ending its requests from here, since the engine thread
        cannot. An engine thread that comes back later stops at once (`_stopping`)."""
        period = min(1.0, self.iteration_timeout / 4)
        while self._thread.is_alive() and not self._stopping:
            time.sleep(period)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.iteration_timeout:
                self.error = EngineStalled(
                    f"an engine iteration has run {time.monotonic() - since:.1f} s, over "
                    f"the {self.iteration_timeout:g} s bound (--engine-iteration-timeout)")
                self._stopping = True
                log.error("engine given up: %s", self.error)
                self._fail_all(self.error)
                return

    def _apply_commands(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "add":
                self._apply_add(*command[1:])
            elif command[0] == "call":
                self._apply_call(*command[1:])
            elif command[0] == "withdraw":
                self._apply_withdraw(*command[1:])
            else:
                self._apply_abort(command[1])

    def _apply_add(self, request_id, request, stream, admitted, loop) -> None:
        prompt, params, admit = request
        try:
            self.connector.admit(self.engine, request_id, prompt, params, **admit)
        except Exception as e:  # noqa: BLE001 -- a bad request must not stop the loop
            post(loop, _settle, admitted, e)
        else:
            self._streams[request_id] = (stream, loop)
            stream.admitted = True
            post(loop, _settle, admitted, None)
        finally:
            self._applied += 1

    def _apply_withdraw(self, stream: RequestStream, on_cancel) -> None:
        """A caller cancelled while its add was pending; its add was applied before this
        (the inbox is in order), so `stream.admitted` tells whether the request is its."""
        if not stream.admitted:
            return
        request_id = stream.request_id
        if self._streams.get(request_id, (None,))[0] is stream:
            del self._streams[request_id]
        self.engine.abort(request_id)
        if on_cancel is not None:
            try:
                on_cancel(self.engine)
            except Exception:  # noqa: BLE001 -- one caller's cleanup must not stop the loop
                log.exception("cleanup of cancelled request %s failed", request_id)

    def _apply_call(self, fn, done, loop) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:  # noqa: BLE001 -- handed to the caller
            post(loop, _settle, done, e)
        else:
            post(loop, _resolve, done, result)

    def _apply_abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream, loop = entry
            by_loop.setdefault(loop, []).append((stream, _detach(out)))
        for loop, items in by_loop.items():
            if not post(loop, _put_all, items):  # its caller is gone: so are its requests
                for stream, out in items:
                    if not out.finished:
                        self._streams.pop(out.request_id, None)
                        self.engine.abort(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        """End every stream and queued command with `error`: from the engine thread as it
        stops, or the watchdog's while the engine thread hangs (a copy of the streams,
        taken whole under the GIL; the deque's pops are atomic)."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream, loop in streams:
            post(loop, stream._put, error)
        while self._inbox:
            try:
                command = self._inbox.popleft()
            except IndexError:  # the other thread took the last one
                break
            if command[0] in ("add", "call"):  # their last two fields: future, its loop
                post(command[-1], _settle, command[-2], error)

    def _snapshot(self) -> dict:
        """Counters read on the engine thread, so the loop never touches the
        engine's state while a step changes it."""
        m = self.engine.metrics()
        c = self.engine.config
        return {
            "num_running": m["num_running"], "num_waiting": m["num_waiting"],
            "num_blocks": c.num_blocks, "free_blocks": m["free_blocks"],
            "num_slots": c.num_slots, "free_slots": m["free_slots"],
            "kv_cache_usage": m["kv_cache_usage"],
            "state_slot_usage": 1 - m["free_slots"] / c.num_slots,
            "kv_bytes_in_use": m["kv_bytes_in_use"], "state_bytes_in_use": m["state_bytes_in_use"],
            "num_preemptions": m["num_preemptions"],
            "serving_compiles": m["serving_compiles"],
            "prefix_cache_queries": m["prefix_cache_queries"],
            "prefix_cache_hits": m["prefix_cache_hits"],
            "iteration_tokens": m.get("iteration_tokens"),
            **{k: m[k] for k in m if k.startswith("spec_decode_")},
            **{k: m[k] for k in ("device_busy_s", "device_idle_s", "device_steps") if k in m},
        }


def post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run ``fn(*args)`` on a caller's ``loop``, from the engine thread; whether it could.
    A loop that has closed belongs to a caller that is gone (its ``asyncio.run``
    returned): what was meant for it is dropped, and the engine thread serves on."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        return False
    return True


def _detach(out: RequestOutput) -> RequestOutput:
    """A copy whose lists the engine will not keep appending to."""
    return dataclasses.replace(
        out, token_ids=list(out.token_ids), new_token_ids=list(out.new_token_ids),
        logprobs=list(out.logprobs) if out.logprobs is not None else None)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _put_all(items) -> None:
    for stream, out in items:
        stream._put(out)

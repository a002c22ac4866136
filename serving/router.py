"""The router: prefill on one worker, decode on another, one stream to the caller.

It is a ``serving.api.backend.Backend``, so the OpenAI server fronts a
disaggregated pair exactly as it fronts the aggregated engine.  For each
request it posts the prompt to a prefill worker (whose answer is the first token
and the ticket of the pinned cache), then posts it to a decode worker, which claims
and pulls the cache itself and sends its tokens on the router's output channel there
(``serving.output_channel``: one stream per decode worker, a line per engine step).
Each worker is the least loaded, with a worker it sent the prompt's prefix before
counting as up to one request less loaded (``serving.worker_pool``: there the prefix
is likely cached, and a decode worker that has it pulls only the rest).  The router
never touches cache memory; it only carries tickets.  Every call carries the workers'
shared secret, and every message is a ``serving.messages`` model.

The decode workers pull only from prefill workers the router registered with them
(``Sources``): the router learns each prefill worker's transfer address from its
``/stats`` (or the ticket it answers) and registers the set with every decode worker
before it sends one a request, again whenever a decode worker restarts.

Faults surface as errors on the affected request only: an unreachable or dying
worker (connection error or timeout on the HTTP call), a prefill worker whose engine
thread has stopped (a 503 that says ``engine_dead``), or a decode worker refusing what
a prefill worker accepted, raises ``WorkerFailed``; a worker whose engine stopped is
passed over until a health poll finds it well (a request that meets such a decode
worker goes on to another); with no live worker of a role, a request is refused at
once (``Unavailable``, 503) rather than prefilled for nothing.  A decode worker that
refuses connections is gone: the prefill workers are told to free the leases it
claimed (``PeerLost``) instead of holding them until they expire.  A decode worker
that reports a failed transfer ends the request with that message; a channel that
breaks ends every request on it.  Closing a stream before its request ends tells the
worker to abort it (``/abort``).  A request no decode worker took (every one full,
gone or failing, or the caller went away first) has its lease freed on the prefill
worker at once (``/abandon``), not at its expiry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from serving import bucket_counts
from serving.engine import RequestOutput, SamplingParams
from serving.errors import EngineDead, EngineOverloaded, Unavailable, WorkerFailed
from serving.messages import (ROUTER_IDLE_SECONDS, Abandon, DecodeAbort, DecodeRequest,
                              PeerLost, PrefillRequest, PrefillResult, Sampling, Sources)
from serving.output_channel import OutputChannel
from serving.worker_pool import WorkerPool
from serving.secret import header

log = logging.getLogger(__name__)

__all__ = ["Router", "RouterStream", "WorkerFailed"]


class RouterStream:
    """Outputs of one routed request: the prefill's first token, then its frames from the
    decode worker's output channel."""

    def __init__(self, router: "Router", request_id: str, first: RequestOutput, decode,
                 on_output: Callable[[RequestOutput], None] | None):
        self.request_id = request_id
        self._router, self._first, self._decode = router, first, decode  # (url, channel, queue)
        self._on_output = on_output or (lambda out: None)  # frames are never joined here
        self._closed = self._done = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        self._on_output(self._first)
        yield self._first
        if self._first.finished:
            return
        url, _, queue = self._decode
        tokens = list(self._first.token_ids)
        logprobs = list(self._first.logprobs or [])
        try:
            while True:
                frame = await queue.get()
                if isinstance(frame, WorkerFailed):  # the channel failed
                    self._done = True
                    raise frame
                if frame.error is not None:
                    self._done = True
                    raise WorkerFailed(f"decode worker {url}: {frame.error}")
                tokens += frame.new_token_ids
                logprobs += frame.logprobs or []
                self._done = frame.finished
                out = RequestOutput(
                    request_id=self.request_id, prompt_token_ids=self._first.prompt_token_ids,
                    token_ids=list(tokens), new_token_ids=frame.new_token_ids,
                    finished=frame.finished, finish_reason=frame.finish_reason,
                    stop_reason=frame.stop_reason,
                    logprobs=list(logprobs) if self._first.logprobs is not None else None,
                    num_preemptions=frame.num_preemptions,
                    num_cached_tokens=self._first.num_cached_tokens)
                self._on_output(out)
                yield out
                if frame.finished:
                    return
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Leave the channel, abort the request on the worker unless it has ended, and drop
        its load; also when the stream was never iterated (a sibling choice failed)."""
        if self._closed:
            return
        self._closed = True
        if self._decode is not None:
            url, channel, _ = self._decode
            channel.unregister(self.request_id)
            self._router.decode.load[url] -= 1
            if not self._done and channel.id is not None:
                self._router._abort(url, self.request_id, channel.id)


class Router:
    """A Backend over prefill and decode workers reached by HTTP with ``secret``."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, secret: str,
                 max_model_len: int, max_logprobs: int, request_timeout: float = 120.0,
                 connect_timeout: float = 5.0, decode_retry_seconds: float = 20.0,
                 block_size: int = 16):
        self.prefill = WorkerPool(prefill_urls, block_size)
        self.decode = WorkerPool(decode_urls, block_size)
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.decode_retry_seconds = decode_retry_seconds
        timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self._client = httpx.AsyncClient(timeout=timeout, headers=header(secret),
                                         limits=httpx.Limits(
                                             max_connections=None,
                                             keepalive_expiry=ROUTER_IDLE_SECONDS))
        self._health: dict[str, str | None] = {u: None for u in self.prefill.urls + self.decode.urls}
        self._stats: dict[str, dict] = {}
        self._sources: dict[str, tuple[str, int]] = {}  # prefill url -> its transfer address
        self._registered: dict[str, frozenset] = {}  # decode url -> the sources it was given
        self._agents: dict[str, str] = {}  # decode url -> its transfer agent, as last seen
        self._poller: asyncio.Task | None = None
        self._channels: dict[str, OutputChannel] = {}  # decode url -> its output channel
        self._notices: set[asyncio.Task] = set()  # _notify's posts in flight (kept referenced)

    @classmethod
    def from_workers(cls, prefill_urls: list[str], decode_urls: list[str], *, secret: str,
                     **kw) -> "Router":
        """Read the limits from the workers' /info (they must agree)."""
        infos = [httpx.get(f"{u}/info", timeout=10, headers=header(secret)).raise_for_status()
                 .json() for u in prefill_urls + decode_urls]
        lens = {i["max_model_len"] for i in infos}
        lps = {i["max_logprobs"] for i in infos}
        models = {i["model"] for i in infos}
        if len(models) != 1:
            raise ValueError(f"workers serve different models: {sorted(models)}")
        sizes = {i["compat"]["block_size"] for i in infos}
        if len(sizes) != 1:
            raise ValueError(f"workers use different block sizes: {sorted(sizes)}")
        router = cls(prefill_urls, decode_urls, secret=secret, max_model_len=min(lens),
                     max_logprobs=min(lps), block_size=sizes.pop(), **kw)
        for url, info in zip(prefill_urls + decode_urls, infos):
            router._saw(url, info)
        return router

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  *, on_output: Callable[[RequestOutput], None] | None = None
                  ) -> RouterStream:
        self._ensure_polling()
        down = self._down()
        if set(self.decode.urls) <= down:  # prefilling it would only hold memory for nothing
            raise Unavailable(f"no decode worker is live: {self._why(self.decode.urls)}")
        keys = self.prefill.prefixes.keys(prompt_token_ids)
        url = self.prefill.pick(exclude=down, keys=keys)
        if url is None:
            raise Unavailable(f"no prefill worker is live: {self._why(self.prefill.urls)}")
        body = PrefillRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                              params=Sampling.of(params))
        self.prefill.prefixes.record(keys, url)
        self.prefill.load[url] += 1
        try:
            r = await self._client.post(f"{url}/prefill", content=body.model_dump_json(),
                                        headers={"Content-Type": "application/json"})
        except httpx.TransportError as e:
            self._health[url] = repr(e)  # skipped until a health poll finds it again
            raise WorkerFailed(f"prefill worker {url} failed: {e!r}") from None
        finally:
            self.prefill.load[url] -= 1
        result = self._checked(r, url, PrefillResult)
        first = RequestOutput(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids),
            token_ids=list(result.token_ids), new_token_ids=list(result.token_ids),
            finished=result.transfer is None, finish_reason=result.finish_reason,
            stop_reason=result.stop_reason, logprobs=result.logprobs,
            num_cached_tokens=result.num_cached_tokens,
            metrics={"queue_s": result.queue_seconds})
        if first.finished:
            return RouterStream(self, request_id, first, None, on_output)
        self._sources[url] = tuple(result.transfer.address)
        try:
            decode = await self._start_decode(dict(
                request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                first_token=result.token_ids[-1], params=Sampling.of(params),
                transfer=result.transfer,
                draft_token_ids=result.draft_token_ids), keys)
        except BaseException:  # no decode worker took it: its lease need not wait to expire
            self._notify(url, "/abandon", Abandon(lease=result.transfer.lease), timeout=2.0)
            raise
        return RouterStream(self, request_id, first, decode, on_output)

    async def _start_decode(self, fields: dict, keys: list[bytes]):
        """Post the ``DecodeRequest`` of ``fields`` to a decode worker, naming its output
        channel; (url, channel, the request's frame queue)."""
        request_id = fields["request_id"]
        deadline = asyncio.get_running_loop().time() + self.decode_retry_seconds
        tried: set[str] = set(self._down())
        while True:
            url = self.decode.pick(exclude=tried, keys=keys)
            if url is None:  # every live one is full, or gone
                if not set(self.decode.urls) - self._down():
                    raise Unavailable(f"no decode worker is live: {self._why(self.decode.urls)}")
                if asyncio.get_running_loop().time() >= deadline:
                    raise EngineOverloaded("every decode worker is full")
                tried = set(self._down())  # again, shortly
                await asyncio.sleep(0.05)
                continue
            self.decode.load[url] += 1
            channel = self._channels.get(url)
            if channel is None:
                channel = self._channels[url] = OutputChannel(
                    self._client, url, on_stray=lambda rid, ch, url=url: self._abort(url, rid, ch))
            queue = channel.register(request_id)
            try:
                response = await self._register(url)
                if response is None:
                    response = await channel.open()
                if isinstance(response, str):
                    body = DecodeRequest(**fields, channel=response)
                    response = await self._client.post(
                        f"{url}/decode", content=body.model_dump_json(),
                        headers={"Content-Type": "application/json"})
            except httpx.TransportError as e:
                channel.unregister(request_id)
                self.decode.load[url] -= 1
                tried.add(url)
                # a refused connection never reached the worker: another may take it
                if isinstance(e, httpx.ConnectError):
                    self._gone(url, repr(e))
                    continue
                self._health[url] = repr(e)
                if channel.id is not None:  # in case the worker took the request
                    self._abort(url, request_id, channel.id)
                raise WorkerFailed(f"decode worker {url} failed: {e!r}") from None
            except BaseException:  # cancelled (the caller went away), or no channel
                channel.unregister(request_id)
                self.decode.load[url] -= 1
                if channel.id is not None:  # in case the worker took the request
                    self._abort(url, request_id, channel.id)
                raise
            if response.status_code == 200:
                self.decode.prefixes.record(keys, url)
                return url, channel, queue
            channel.unregister(request_id)
            self.decode.load[url] -= 1
            tried.add(url)
            if self._engine_died(response, url):
                continue
            if response.status_code == 503 and asyncio.get_running_loop().time() < deadline:
                continue
            if response.status_code == 503:  # still full when the retries ran out
                raise EngineOverloaded(f"{url}: {_detail(response)}")
            # the prefill worker accepted this request: a refusal here (say, stale
            # params after a prefill restart) is the system's failure, not the client's
            raise WorkerFailed(f"decode worker {url} refused the request "
                               f"({response.status_code}: {_detail(response)})")

    async def _register(self, url: str) -> httpx.Response | None:
        """Give decode worker ``url`` the prefill workers' transfer addresses, unless it has
        them already; its answer if it refused them (read, for the caller to judge)."""
        wanted = frozenset(self._sources.values())
        if self._registered.get(url) == wanted:
            return None
        body = Sources(addresses=sorted(wanted))
        r = await self._client.post(f"{url}/sources", content=body.model_dump_json(),
                                    headers={"Content-Type": "application/json"})
        if r.status_code != 200:
            return r
        self._registered[url] = wanted
        return None

    def _checked(self, response: httpx.Response, url: str, model):
        if response.status_code == 200:
            try:
                return model.model_validate_json(response.content)
            except ValidationError as e:
                raise WorkerFailed(f"worker {url} answered a malformed {model.__name__}: "
                                   f"{e}") from None
        detail = _detail(response)
        if response.status_code == 400:
            raise ValueError(detail)
        if self._engine_died(response, url):
            raise WorkerFailed(f"worker {url}: {detail}")
        if response.status_code == 503:
            raise EngineOverloaded(f"{url}: {detail}")
        raise WorkerFailed(f"worker {url} answered {response.status_code}: {detail}")

    def _engine_died(self, response: httpx.Response, url: str) -> bool:
        """Whether ``response`` (read) is a 503 saying the worker's engine thread stopped,
        not merely that it is full; such a worker is marked down, so it is passed over
        until a health poll finds it well."""
        if response.status_code != 503:
            return False
        try:
            dead = bool(response.json().get("engine_dead"))
        except (ValueError, AttributeError):
            return False
        if dead:
            self._health[url] = f"engine dead: {_detail(response)}"
        return dead

    def _down(self) -> set[str]:
        return {u for u, e in self._health.items() if e is not None}

    def _why(self, urls) -> dict:
        return {u: self._health[u] for u in urls}

    def _saw(self, url: str, info: dict) -> None:
        """A worker's ``/info`` or ``/stats``: a prefill worker's transfer address, a decode
        worker's agent (a new one is a restarted worker, which must be registered again)."""
        if url in self.prefill.load:
            self._sources[url] = tuple(info["transfer_address"])
        elif info.get("agent") != self._agents.get(url):
            self._agents[url] = info["agent"]
            self._registered.pop(url, None)

    def _gone(self, url: str, why: str) -> None:
        """Decode worker ``url`` refuses connections: its process is gone. Mark it down and
        have the prefill workers free the leases its agent claimed."""
        self._health[url] = why
        agent = self._agents.pop(url, None)
        self._registered.pop(url, None)
        if agent is None:
            return
        for prefill_url in self.prefill.urls:  # unreachable: its leases expire by themselves
            self._notify(prefill_url, "/peer_lost", PeerLost(agent=agent), timeout=2.0)

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by closing their stream (``RouterStream.aclose``)."""

    def _abort(self, url: str, request_id: str, channel: str) -> None:
        """Tell decode worker ``url`` that ``request_id``'s caller went away (a worker that
        cannot be told has lost the channel, which aborted the request)."""
        self._notify(url, "/abort", DecodeAbort(request_id=request_id, channel=channel),
                     timeout=5.0)

    def _notify(self, url: str, path: str, message, timeout: float) -> None:
        """Post ``message`` to ``url + path`` in the background: the caller does not wait,
        and a worker that cannot be reached is past being told."""
        async def tell():
            try:
                await self._client.post(f"{url}{path}", content=message.model_dump_json(),
                                        timeout=timeout,
                                        headers={"Content-Type": "application/json"})
            except httpx.TransportError:
                pass

        task = asyncio.get_running_loop().create_task(tell())
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def stats(self) -> dict:
        """Sums of the workers' counters as of the last health poll."""
        keys = ("num_running", "num_waiting", "num_blocks", "free_blocks", "num_slots",
                "free_slots", "kv_bytes_in_use", "state_bytes_in_use", "num_preemptions",
                "serving_compiles", "prefix_cache_queries", "prefix_cache_hits", "transfers",
                "transfer_bytes", "transfer_seconds", "transfer_ack_seconds",
                "transfer_descriptors", "transfer_failures", "transfer_cached_tokens",
                "leases_expired", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens")
        total = {k: sum(s.get(k, 0) for s in self._stats.values()) for k in keys}
        per_pos = [s["spec_decode_num_accepted_tokens_per_pos"] for s in self._stats.values()
                   if s.get("spec_decode_num_accepted_tokens_per_pos")]
        total["spec_decode_num_accepted_tokens_per_pos"] = [sum(c) for c in zip(*per_pos)]
        total["device"] = {
            role: {k: sum(self._stats.get(u, {}).get(k, 0) for u in pool.urls)
                   for k in ("device_busy_s", "device_idle_s", "device_steps")}
            for role, pool in (("prefill", self.prefill), ("decode", self.decode))}
        for key in ("iteration_tokens", "transfer_time", "transfer_size", "transfer_descs"):
            total[key] = bucket_counts.add([s.get(key) for s in self._stats.values()])
        total["kv_cache_usage"] = 1 - total["free_blocks"] / max(total["num_blocks"], 1)
        total["state_slot_usage"] = 1 - total["free_slots"] / max(total["num_slots"], 1)
        return total

    def _ensure_polling(self, interval: float = 1.0) -> None:
        """Keep worker health and counters fresh from a task on the serving event loop."""
        if self._poller is not None and not self._poller.done():
            return

        async def loop():
            while True:
                await self.poll_workers()
                await asyncio.sleep(interval)

        self._poller = asyncio.get_running_loop().create_task(loop())

    async def poll_workers(self) -> None:
        """Refresh health and counters of every worker."""
        async def one(url):
            try:
                r = await self._client.get(f"{url}/stats", timeout=2.0)
                r.raise_for_status()
                self._stats[url], self._health[url] = r.json(), None
                self._saw(url, self._stats[url])
            except httpx.ConnectError as e:
                if url in self.decode.load:
                    self._gone(url, repr(e))
                else:
                    self._health[url] = repr(e)
            except Exception as e:  # noqa: BLE001 -- recorded as the worker's health
                self._health[url] = repr(e)
        await asyncio.gather(*(one(u) for u in self._health))

    def check_health(self) -> None:
        try:
            self._ensure_polling()
        except RuntimeError:  # no running event loop: called outside the server
            pass
        down = self._down()
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if set(pool.urls) <= down:
                raise EngineDead(f"no {role} worker answers: {self._why(pool.urls)}")

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for channel in self._channels.values():
            channel.close()


def _detail(response: httpx.Response) -> str:
    try:
        return response.json().get("detail", response.text)
    except ValueError:
        return response.text

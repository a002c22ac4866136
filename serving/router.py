"""The router: prefill on one worker, decode on another, one stream to the caller.

It is a ``serving.api.backend.Backend``, so the OpenAI server fronts a
disaggregated pair exactly as it fronts the aggregated engine.  For each
request it posts the prompt to the least-loaded prefill worker (whose answer is
the first token and the transfer parameters), then streams the rest from the
least-loaded decode worker, which pulls the cache itself.  The router never
touches cache memory; it only carries the parameters.

Faults surface as errors on the affected request only: an unreachable or dying
worker (connection error or timeout on the HTTP call), a prefill worker whose engine
thread has stopped (a 503 that says ``engine_dead``), or a decode worker refusing what
a prefill worker accepted, raises ``WorkerFailed``; a worker whose engine stopped is
passed over until a health poll finds it well (a request that meets such a decode
worker goes on to another);
a decode worker that reports a failed transfer ends the stream with that
message.  Closing a stream closes its HTTP call, which aborts the request on
the worker.  Whatever the prefill side pinned is freed by its lease when no
decode worker pulls it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import httpx

from serving.async_engine import EngineDead, EngineOverloaded
from serving.engine import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A worker did not answer (died, hung or closed the connection) for this request."""


class _Pool:
    """Workers of one role, picked by fewest outstanding requests (ties rotate)."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("need at least one worker of each role")
        self.urls = list(urls)
        self.load = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def pick(self, exclude=()) -> str:
        choices = [u for u in self.urls if u not in exclude] or self.urls
        start = next(self._turn)
        rotated = choices[start % len(choices):] + choices[:start % len(choices)]
        return min(rotated, key=self.load.__getitem__)


class RouterStream:
    """Outputs of one routed request: the prefill's first token, then the decode stream."""

    def __init__(self, router: "Router", request_id: str, first: RequestOutput, decode):
        self.request_id = request_id
        self._router, self._first, self._decode = router, first, decode  # decode: (url, response)
        self._closed = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        yield self._first
        if self._first.finished:
            return
        url, response = self._decode
        tokens = list(self._first.token_ids)
        logprobs = list(self._first.logprobs or [])
        try:
            async for line in response.aiter_lines():
                if not line:
                    continue
                d = json.loads(line)
                if "error" in d:
                    raise WorkerFailed(f"decode worker {url}: {d['error']}")
                tokens += d["new_token_ids"]
                if d.get("logprobs"):
                    logprobs += d["logprobs"]
                yield RequestOutput(
                    request_id=self.request_id, prompt_token_ids=self._first.prompt_token_ids,
                    token_ids=list(tokens), new_token_ids=d["new_token_ids"],
                    finished=d["finished"], finish_reason=d["finish_reason"],
                    stop_reason=d["stop_reason"],
                    logprobs=list(logprobs) if self._first.logprobs is not None else None,
                    num_preemptions=d.get("num_preemptions", 0))
                if d["finished"]:
                    return
            raise WorkerFailed(f"decode worker {url} closed the stream before the request finished")
        except (httpx.TransportError, httpx.StreamError) as e:
            raise WorkerFailed(f"decode worker {url} failed mid-request: {e!r}") from None
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the decode stream (the worker then aborts the request) and drop its
        load; also when the stream was never iterated (a sibling choice failed)."""
        if self._closed:
            return
        self._closed = True
        if self._decode is not None:
            url, response = self._decode
            await response.aclose()
            self._router.decode.load[url] -= 1


class Router:
    """A Backend over prefill and decode workers reached by HTTP."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, max_model_len: int,
                 max_logprobs: int, request_timeout: float = 120.0,
                 connect_timeout: float = 5.0, decode_retry_seconds: float = 20.0):
        self.prefill, self.decode = _Pool(prefill_urls), _Pool(decode_urls)
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.decode_retry_seconds = decode_retry_seconds
        timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        self._health: dict[str, str | None] = {u: None for u in self.prefill.urls + self.decode.urls}
        self._stats: dict[str, dict] = {}
        self._poller: asyncio.Task | None = None

    @classmethod
    def from_workers(cls, prefill_urls: list[str], decode_urls: list[str], **kw) -> "Router":
        """Read the limits from the workers' /info (they must agree)."""
        infos = [httpx.get(f"{u}/info", timeout=10).json() for u in prefill_urls + decode_urls]
        lens = {i["max_model_len"] for i in infos}
        lps = {i["max_logprobs"] for i in infos}
        models = {i["model"] for i in infos}
        if len(models) != 1:
            raise ValueError(f"workers serve different models: {sorted(models)}")
        return cls(prefill_urls, decode_urls, max_model_len=min(lens), max_logprobs=min(lps), **kw)

    async def add(self, request_id: str, prompt_token_ids: list[int],
                  params: SamplingParams) -> RouterStream:
        self._ensure_polling()
        url = self.prefill.pick(exclude=self._down())
        self.prefill.load[url] += 1
        try:
            r = await self._client.post(f"{url}/prefill", json={
                "request_id": request_id, "prompt_token_ids": list(prompt_token_ids),
                "params": _params_json(params)})
        except httpx.TransportError as e:
            self._health[url] = repr(e)  # skipped until a health poll finds it again
            raise WorkerFailed(f"prefill worker {url} failed: {e!r}") from None
        finally:
            self.prefill.load[url] -= 1
        result = self._checked(r, url)
        first = RequestOutput(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids),
            token_ids=result["token_ids"], new_token_ids=list(result["token_ids"]),
            finished=result["transfer"] is None, finish_reason=result["finish_reason"],
            stop_reason=result["stop_reason"], logprobs=result["logprobs"])
        if first.finished:
            return RouterStream(self, request_id, first, None)
        decode = await self._start_decode(request_id, prompt_token_ids, params, result)
        return RouterStream(self, request_id, first, decode)

    async def _start_decode(self, request_id, prompt, params, result):
        body = {"request_id": request_id, "prompt_token_ids": list(prompt),
                "first_token": result["token_ids"][-1], "params": _params_json(params),
                "transfer": result["transfer"]}
        deadline = asyncio.get_running_loop().time() + self.decode_retry_seconds
        tried: set[str] = set(self._down())
        while True:
            url = self.decode.pick(exclude=tried)
            self.decode.load[url] += 1
            try:
                req = self._client.build_request("POST", f"{url}/decode", json=body)
                response = await self._client.send(req, stream=True)
            except httpx.TransportError as e:
                self.decode.load[url] -= 1
                self._health[url] = repr(e)
                tried.add(url)
                # a refused connection never reached the worker: another may take it
                if isinstance(e, httpx.ConnectError) and not tried >= set(self.decode.urls):
                    continue
                raise WorkerFailed(f"decode worker {url} failed: {e!r}") from None
            except BaseException:  # cancelled: the caller went away
                self.decode.load[url] -= 1
                raise
            if response.status_code == 200:
                return url, response
            await response.aread()
            await response.aclose()
            self.decode.load[url] -= 1
            tried.add(url)
            if self._engine_died(response, url):
                if tried >= set(self.decode.urls):
                    raise WorkerFailed(f"no decode worker serves: {_detail(response)}")
                continue
            if response.status_code == 503 and asyncio.get_running_loop().time() < deadline:
                if tried >= set(self.decode.urls):
                    tried = set(self._down())  # every live one is full: again, shortly
                    await asyncio.sleep(0.05)
                continue
            if response.status_code == 503:  # still full when the retries ran out
                raise EngineOverloaded(f"{url}: {_detail(response)}")
            # the prefill worker accepted this request: a refusal here (say, stale
            # params after a prefill restart) is the system's failure, not the client's
            raise WorkerFailed(f"decode worker {url} refused the request "
                               f"({response.status_code}: {_detail(response)})")

    def _checked(self, response: httpx.Response, url: str) -> dict:
        if response.status_code == 200:
            return response.json()
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

    async def abort(self, request_id: str) -> None:
        """Requests are aborted by closing their stream (the worker sees the disconnect)."""

    def stats(self) -> dict:
        """Sums of the workers' counters as of the last health poll."""
        keys = ("num_running", "num_waiting", "num_blocks", "free_blocks", "num_slots",
                "free_slots", "kv_bytes_in_use", "state_bytes_in_use", "num_preemptions",
                "serving_compiles", "transfers",
                "transfer_bytes", "transfer_seconds", "transfer_ack_seconds",
                "transfer_descriptors", "transfer_failures")
        total = {k: sum(s.get(k, 0) for s in self._stats.values()) for k in keys}
        total["device"] = {
            role: {k: sum(self._stats.get(u, {}).get(k, 0) for u in pool.urls)
                   for k in ("device_busy_s", "device_idle_s", "device_steps")}
            for role, pool in (("prefill", self.prefill), ("decode", self.decode))}
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
                raise EngineDead(f"no {role} worker answers: "
                                 f"{ {u: self._health[u] for u in pool.urls} }")

    def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


def _params_json(params: SamplingParams) -> dict:
    import dataclasses

    return dataclasses.asdict(params)


def _detail(response: httpx.Response) -> str:
    try:
        return response.json().get("detail", response.text)
    except ValueError:
        return response.text

"""A prefill or decode worker: one engine, its cache in registered memory, a NIXL
transfer endpoint, and a small HTTP API for the router.

    python -m serving.worker --role prefill --model tiny --port 8101
    python -m serving.worker --role decode  --model tiny --port 8102

Prefill (``POST /prefill``): computes the prompt, samples the first token and,
if the request goes on, pins the prompt's KV blocks and GDN state under a lease
and returns the transfer parameters with the token.  The memory is freed when
the decode side's READ notification arrives, when the decode side drops the
lease, or when the lease expires.

Decode (``POST /decode``, NDJSON stream): reserves fresh blocks and a slot,
READs the prefill side's bytes into them, and only then lets the engine
schedule the request, starting after the prompt with the first token already
known; so no token is applied to the GDN state twice.  A failed or timed-out
transfer ends the request with an error, or recomputes the prompt locally with
``--on-transfer-failure recompute``.  A client that disconnects aborts its
request.

With ``--ep``/``--tp`` the engine runs on a mesh and its cache is one registered
region per device shard (``kv_transfer.allocate_registered_cache``); prefill and decode
workers may be split differently (prefill TP2, decode EP2, say): the prefill side
sends its cache layout and the request's blocks and slot with the lease
(``kv_transfer.source_record``), and the decode side reads the parts of rows its
own split needs (``kv_transfer.pull_items``), checked to lie inside the pinned
bytes.  On GPU every device's shard is cudaMalloc'd memory imported through DLPack
(``transfer.memory.allocate_sharded``), which cuda_ipc reaches; on CPU it is XLA's
own host memory.

Threads: the engine thread owns the engine and the transfer manager: it pins,
pulls (``AsyncEngine.call`` and submits) and, in its tick between steps, collects
what the transfers hand back (freed leases, landed READs, completions), since
each of those changes the engine.  A ``transfer.ProgressThread`` runs the
protocol meanwhile and wakes the engine thread when it leaves something to
collect, so a prefill worker acks the decode side's ``done`` at once even in the
middle of a long prefill step, and the lease's blocks go back to the pools at
the next tick, through the step fence.  Acking first is safe: NIXL delivers
``done`` only after the READ's data has landed, so nothing reads those blocks
any more, and no step can write them before the tick releases them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time
import uuid

import jax
import jax.numpy as jnp
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.capacity import plan_capacity
from serving.kv_transfer import (allocate_registered_cache, compat_record, pull_items,
                                 source_record)
from serving.llm import default_dtype, load_model, model_config
from transfer import (Agent, Faults, HandshakeError, ProgressThread, TransferManager,
                      TransferParamsError, free_bytes, size_xla_pool)

log = logging.getLogger("serving.worker")


class TransferFailed(RuntimeError):
    """The request's KV/state transfer failed; the message says how."""


class Worker:
    """Engine + transfer manager of one role; the HTTP handlers call into this."""

    def __init__(self, role: str, model, config: EngineConfig, *, model_name: str, dtype,
                 lease_ttl: float = 30.0, transfer_timeout: float = 30.0,
                 recompute_on_failure: bool = False, faults: Faults | None = None,
                 host: str = "127.0.0.1", transfer_port: int = 0, tokenizer=None):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role, self.model_name = role, model_name
        self.transfer_timeout, self.recompute = transfer_timeout, recompute_on_failure
        cfg, mesh = model.config, config.mesh()
        self.sharded = mesh is not None
        # The budget is one device's (plan_capacity sizes a device's shard of a block or
        # slot): the least any of the engine's devices has free beside XLA's pool.
        free = [free_bytes(d) for d in (mesh.devices.flat if self.sharded else jax.devices()[:1])]
        self.capacity = plan_capacity(cfg, config, dtype, mesh=mesh,
                                      budget_bytes=None if None in free else min(free))
        cache, regions, self.layout = allocate_registered_cache(
            cfg, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_slots, dtype=dtype, ssm_dtype=jnp.dtype(config.ssm_dtype),
            mesh=mesh)
        self.compat = compat_record(cfg, cache, model_name)
        self.regions = {r.name: r for r in regions}
        # the tokenizer checks stop strings, on both sides: the first token can end one
        engine = Engine(model, cache, config, tokenizer=tokenizer, batch_type=_batch_type())
        # unique across restarts: a peer keeps a known name's metadata, so a restarted
        # worker must not come back under its old one (an object id can repeat)
        self.agent = Agent(regions, name=f"{role}-{uuid.uuid4().hex}")
        self.transfer = TransferManager(self.agent, self.compat, host=host, port=transfer_port,
                                        lease_ttl=lease_ttl, faults=faults)
        self._pulls: dict[int, str] = {}  # pull id -> request id (engine thread only)
        self._started: set[int] = set()  # pulls whose request decodes before the ack
        # failed pulls whose READ may still write into the memory their request gave up
        # (Engine.abandon_transfer): pull id -> (blocks, slot), freed once the READ ended
        self._draining: dict[int, tuple[list[int], int | None]] = {}
        # request id -> (future, its loop), resolved when the transfer is acked or fails
        # (see `decode`)
        self._confirmations: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}
        # transfer_ack_seconds: of transfer_seconds, the time from the READ's landing to the
        # source's ack, during which the request's outputs are held
        self.counters = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0,
                         "transfer_ack_seconds": 0.0, "transfer_descriptors": 0,
                         "transfer_failures": 0, "leases_expired": 0}
        # only the engine thread resolves confirmations (_tick): if it stops, they fail
        self.engine = AsyncEngine(engine, tick=self._tick, on_stop=self._fail_confirmations)
        self.progress = ProgressThread(self.transfer, on_ready=self.engine.wake)

    # ---- prefill ------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
        """Prompt -> first token, plus transfer params when the request continues."""
        first = dataclasses.replace(params, max_tokens=1)
        try:
            stream = await self.engine.add(
                request_id, prompt, first,
                submit=lambda eng: eng.add_request(prompt, first, request_id,
                                                   hold_on_finish=True))
        except asyncio.CancelledError:  # admitted or not: no one would release its hold
            await self.engine.call(lambda eng: _release_quietly(eng, request_id))
            raise
        out = None
        try:
            async for out in stream:
                pass
        except BaseException:
            await self.engine.call(lambda eng: _release_quietly(eng, request_id))
            raise
        goes_on = out.finish_reason == "length" and params.max_tokens > 1
        result = {"token_ids": list(out.token_ids), "logprobs": out.logprobs,
                  "finish_reason": None if goes_on else out.finish_reason,
                  "stop_reason": out.stop_reason, "transfer": None}
        if goes_on:
            result["transfer"] = await self.engine.call(
                lambda eng: self._pin(eng, request_id, len(prompt)))
        else:
            await self.engine.call(lambda eng: eng.release(request_id))
        return result

    def _pin(self, eng, request_id: str, num_tokens: int) -> dict:
        req = eng.requests[request_id]
        items = self.layout.items(req.block_ids, req.slot, num_tokens)

        def on_free(lease: str, reason: str) -> None:
            if reason == "expired":
                self.counters["leases_expired"] += 1
                log.warning("lease %s of %s expired before a decode worker pulled it",
                            lease, request_id)
            eng.release(request_id)

        try:
            self._settle(eng)
            return {**self.transfer.pin(items, on_free=on_free),
                    "cache": source_record(self.layout, req.block_ids, req.slot, num_tokens)}
        except Exception:
            eng.release(request_id)
            raise

    # ---- decode -------------------------------------------------------------------------

    async def decode(self, request_id: str, prompt: list[int], first_token: int,
                     params: SamplingParams, transfer: dict):
        """Pull the prompt's cache, then decode. Returns the engine's output stream and a
        future that the caller must await before sending any output: it resolves once
        the source has acked the transfer, or raises TransferFailed.

        Decoding starts as soon as the READ has landed, one ack round trip before the
        ack; the outputs wait on the future, so none computed from bytes the source had
        already reused (a "stale" ack) ever leave the worker."""
        if request_id in self._confirmations:  # its entry is another request's
            raise ValueError(f"duplicate request id {request_id}")
        loop = asyncio.get_running_loop()
        if not self.transfer.knows_source(transfer):  # a new source: shake hands off the
            try:                                       # engine thread, where pull() runs
                await loop.run_in_executor(None, self.transfer.connect_source, transfer)
            except HandshakeError as e:
                raise TransferFailed(f"transfer source unreachable: {e}") from None
            if request_id in self._confirmations:  # taken while this one waited
                raise ValueError(f"duplicate request id {request_id}")
        confirmed = loop.create_future()
        self._confirmations[request_id] = (confirmed, loop)
        try:
            stream = await self.engine.add(
                request_id, prompt, params,
                submit=lambda eng: self._start_pull(eng, request_id, prompt, first_token, params,
                                                    transfer))
        except BaseException:
            self._confirmations.pop(request_id, None)
            raise
        return stream, confirmed

    def _fail_confirmations(self, error: BaseException) -> None:
        """The engine thread stopped: no pull will be confirmed (engine thread)."""
        for request_id in list(self._confirmations):
            self._confirm(request_id, error)

    def _confirm(self, request_id: str, error: BaseException | None = None) -> None:
        """Resolve the request's confirmation (engine thread); every pull ends here."""
        entry = self._confirmations.pop(request_id, None)
        if entry is None:
            return
        future, loop = entry

        def resolve():
            if not future.done():
                future.set_result(None) if error is None else future.set_exception(error)

        loop.call_soon_threadsafe(resolve)

    def _start_pull(self, eng, request_id, prompt, first_token, params, transfer) -> None:
        reserved = eng.add_remote_request(prompt, first_token, params, request_id)
        if reserved is None:
            raise EngineOverloaded("no free KV blocks or state slot for a transfer now")
        _, blocks, slot = reserved
        try:
            if not isinstance(transfer, dict):
                raise TransferParamsError(f"expected a dict, got {type(transfer).__name__}")
            remote, local = pull_items(transfer.get("cache"), self.layout, blocks, slot,
                                       len(prompt))
            self._settle(eng)
            pull_id = self.transfer.pull(transfer, local, timeout=self.transfer_timeout,
                                         remote_items=remote)
        except BaseException:
            eng.abort(request_id)
            eng.finish_transfer(request_id, ok=False)
            raise
        self._pulls[pull_id] = request_id

    def _settle(self, eng) -> None:
        """Before NIXL touches the cache: on a mesh, wait until every device has finished
        the steps dispatched so far.  The engine takes a step as done once it has read the
        step's tokens, and on a mesh that does not prove every device has finished writing
        its cache shard (seen on CPU in a third of TP2 steps; waiting for the tokens on
        every device was not enough either): the prompt's KV on the source, or on the
        destination a stale step's writes into blocks and a slot just freed and reserved
        for the transfer.  NIXL is ordered with none of it (transfer/memory.py).  One
        device: reading the tokens proves the step done, and nothing waits."""
        if self.sharded:
            jax.block_until_ready(eng.runner.cache)

    def _tick(self, eng) -> None:
        """Between steps, on the engine thread: apply what the transfers handed back."""
        completions = self.transfer.collect()  # runs on_free: leases' memory back to the pools
        landed = self.transfer.landed()
        if not self.recompute:  # (a recompute must not follow tokens already computed)
            for pull_id in landed:
                if pull_id in self._pulls:
                    eng.finish_transfer(self._pulls[pull_id], ok=True)  # decode may start
                    self._started.add(pull_id)
        for c in completions:
            request_id = self._pulls.pop(c.pull_id, None)
            started = c.pull_id in self._started
            self._started.discard(c.pull_id)
            if request_id is None:
                continue
            if c.ok:
                self.counters["transfers"] += 1
                self.counters["transfer_bytes"] += c.nbytes
                self.counters["transfer_seconds"] += c.seconds
                self.counters["transfer_ack_seconds"] += c.phases.get("ack", 0.0)
                self.counters["transfer_descriptors"] += c.descriptors
                if not started:
                    eng.finish_transfer(request_id, ok=True)
                self._confirm(request_id)
                continue
            self.counters["transfer_failures"] += 1
            log.error("transfer for %s failed: %s", request_id, c.error)
            if not self.recompute:
                error = TransferFailed(f"KV/state transfer failed ({c.error})")
                self.engine.fail(request_id, error)
                eng.abort(request_id)
                self._confirm(request_id, error)
                if started:  # it decoded from landed bytes: the abort freed its memory
                    continue
            else:
                self._confirm(request_id)
            # The request's memory is still the transfer's. A READ that has ended: free
            # the memory, or recompute the prompt in it. One that may still land bytes
            # there: the request gives the memory up now (a recompute runs in fresh
            # memory), and the memory stays out of the pools until the READ has ended.
            if c.settled:
                eng.finish_transfer(request_id, ok=False)
            else:
                self._draining[c.pull_id] = eng.abandon_transfer(request_id)
        for pull_id in self.transfer.settled():  # after the completions that it follows
            memory = self._draining.pop(pull_id, None)
            if memory is not None:
                eng.free_memory(memory)

    # ---- status -------------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters, "leases": self.transfer.leases,
                "pending_pulls": len(self._pulls), "draining_pulls": len(self._draining)}

    def info(self) -> dict:
        return {"role": self.role, "model": self.model_name, "agent": self.agent.name,
                "transfer_address": list(self.transfer.address), "compat": self.compat,
                "max_model_len": self.engine.max_model_len,
                "max_logprobs": self.engine.max_logprobs, "capacity": self.capacity}

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.progress.stop()
        self.transfer.close()


def _param_bytes(model: str, dtype: str, ep: int = 1, tp: int = 1) -> int:
    """Bytes of the model's weights that one device of the engine's ``(1, ep, tp)`` mesh
    holds, from the shapes and ``qwen35_jax.sharding``'s table (nothing is allocated and
    no device is asked: JAX's GPU client must not start before ``size_xla_pool``)."""
    from flax import nnx

    import qwen35_jax
    from qwen35_jax.sharding import AXES, param_shardings

    cfg = model_config(model)
    state = nnx.state(qwen35_jax.abstract_model(cfg, jnp.dtype(dtype)))
    shardings = param_shardings(cfg, state, jax.sharding.AbstractMesh((1, ep, tp), AXES))
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True))


def _batch_type():
    from qwen35_jax.batch import Batch

    return Batch


def _release_quietly(eng, request_id: str) -> None:
    """Free a held prefill request whose caller went away before its lease was made."""
    req = eng.requests.get(request_id)
    if req is None:
        return
    if req.is_finished:
        eng.release(request_id)
    else:
        eng.abort(request_id)
        if request_id in eng.requests:
            eng.release(request_id)


def _params(d: dict) -> SamplingParams:
    try:
        return SamplingParams(**d)
    except (TypeError, ValueError) as e:
        raise HTTPException(400, f"bad sampling params: {e}") from None


def output_json(out) -> dict:
    return {"token_ids": list(out.token_ids), "new_token_ids": list(out.new_token_ids),
            "finished": out.finished, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "logprobs": out.logprobs[-len(out.new_token_ids):] if out.logprobs and out.new_token_ids
            else None,
            "num_preemptions": out.num_preemptions}


def build_app(worker: Worker, *, fault_injection: bool = False) -> FastAPI:
    app = FastAPI(title=f"qwen35-jax {worker.role} worker")

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_, e):
        return JSONResponse({"detail": str(e)}, status_code=503)

    @app.exception_handler(EngineDead)
    async def _dead(_, e):
        # "engine_dead" tells the router to stop sending here, where a full engine's
        # 503 only says "try another or later"
        return JSONResponse({"detail": str(e), "engine_dead": True}, status_code=503)

    @app.exception_handler(TransferFailed)
    async def _unreachable(request, e):  # a source this worker could not reach
        return JSONResponse({"detail": str(e)}, status_code=502)

    @app.exception_handler(TransferParamsError)
    async def _bad_params(_, e):
        return JSONResponse({"detail": f"transfer params refused: {e}"}, status_code=400)

    @app.exception_handler(ValueError)
    async def _bad(_, e):
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.get("/health")
    async def health():
        worker.engine.check_health()
        return {"ok": True}

    @app.get("/info")
    async def info():
        return worker.info()

    @app.get("/stats")
    async def stats():
        worker.engine.check_health()  # the router's health poll reads this endpoint
        return worker.stats()

    if fault_injection:
        @app.post("/debug/faults")
        async def faults(body: dict):
            """Make the next pulls fail (``fail_next``) or hang until timeout (``hang_next``)."""
            for key in ("fail_next", "hang_next"):
                setattr(worker.transfer.faults, key, int(body.get(key, 0)))
            return {"ok": True}

    if worker.role == "prefill":
        @app.post("/prefill")
        async def prefill(body: dict):
            return await worker.prefill(str(body["request_id"]), list(body["prompt_token_ids"]),
                                        _params(body.get("params", {})))
    else:
        @app.post("/decode")
        async def decode(body: dict, request: Request):
            stream, confirmed = await worker.decode(
                str(body["request_id"]), list(body["prompt_token_ids"]), int(body["first_token"]),
                _params(body.get("params", {})), body["transfer"])

            async def lines():
                try:
                    await confirmed
                    async for out in stream:
                        yield json.dumps(output_json(out)) + "\n"
                except (TransferFailed, EngineDead) as e:
                    yield json.dumps({"error": str(e), "finished": True}) + "\n"
                finally:
                    await stream.aclose()  # a vanished client aborts its request

            return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def main(argv=None):
    from serving.api.server import engine_kwargs, parser
    from serving.api.text import Tokenizer, find_tokenizer

    p = parser()
    p.prog = "python -m serving.worker"
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--transfer-port", type=int, default=0, help="handshake port (0: any)")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a prefill result stays pinned without a pull")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--on-transfer-failure", choices=["error", "recompute"], default="error")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="expose POST /debug/faults (tests only)")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s {a.role} %(levelname)s %(name)s: %(message)s")
    name = a.model or a.model_tag
    # The cache regions live beside XLA's pool (transfer/memory.py): size the pool before
    # JAX starts its GPU client below, for the weights one device of the mesh holds.
    total = size_xla_pool(_param_bytes(name, a.dtype or "bfloat16", a.ep, a.tp),
                          a.gpu_memory_utilization)
    if total:
        log.info("XLA pool: %s of %.1f GiB", os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
                 total / 2**30)
    dtype = jnp.dtype(a.dtype) if a.dtype else default_dtype()
    config = EngineConfig(seed=a.seed, **engine_kwargs(a))
    model = load_model(name, dtype, a.seed, config.mesh())
    config.eos_token_ids = tuple(model.config.eos_token_ids)
    t0 = time.perf_counter()
    worker = Worker(a.role, model, config, model_name=name, dtype=dtype,
                    lease_ttl=a.lease_ttl, transfer_timeout=a.transfer_timeout,
                    recompute_on_failure=a.on_transfer_failure == "recompute",
                    host=a.host, transfer_port=a.transfer_port,
                    tokenizer=Tokenizer(find_tokenizer(name, a.tokenizer)))
    log.info("%s worker ready in %.1f s on %s: http %s:%d, transfer %s", a.role,
             time.perf_counter() - t0, jax.devices()[0], a.host, a.port,
             worker.transfer.address)
    try:
        uvicorn.run(build_app(worker, fault_injection=a.enable_fault_injection), host=a.host, port=a.port, log_level="warning")
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()

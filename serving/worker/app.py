"""A worker's HTTP API, for the router only.

    GET  /health, /info, /stats
    POST /prefill      PrefillRequest -> PrefillResult                (prefill workers)
    POST /peer_lost    PeerLost: free the leases a gone decode worker claimed  (prefill)
    POST /abandon      Abandon: free a lease no decode worker will claim       (prefill)
    GET  /outputs      NDJSON stream of DecodeOutputs: an output channel  (decode workers)
    POST /decode       DecodeRequest, its frames on the channel it names  (decode)
    POST /abort        DecodeAbort                                        (decode)
    POST /sources      Sources: the prefill workers this one may pull from     (decode)

Every route requires the workers' shared secret (``serving.secret``; 401 without it).
Bodies are validated against ``serving.messages`` (400 naming the field) and limited in
size (413) before any of them reaches the engine; errors are ``{"detail": ...}``, and a
503 that says ``engine_dead`` tells the router to stop sending here.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from serving.body_limit import BodyLimit
from serving.errors import EngineDead, EngineOverloaded, TransferFailed
from serving.messages import Abandon, DecodeAbort, DecodeRequest, PeerLost, PrefillRequest, Sources
from serving.worker.channels import Channels
from serving.secret import bearer_matches
from transfer import TransferParamsError


class _Unauthorised(Exception):
    pass


async def _body(request: Request, model: type[BaseModel]):
    """The request's JSON body as ``model`` (strict, as the sender serialised it)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise ValueError(f"{where}: {first['msg']}") from None


def build_app(worker, *, secret: str, max_body_bytes: int) -> FastAPI:
    async def authorised(request: Request) -> None:
        if not bearer_matches(request.headers.get("authorization"), secret):
            raise _Unauthorised

    app = FastAPI(title=f"qwen35-jax {worker.role} worker", dependencies=[Depends(authorised)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                       error=lambda message, status: {"detail": message})

    @app.exception_handler(_Unauthorised)
    async def _unauthorised(_, e):
        return JSONResponse({"detail": "the workers' shared secret is required"},
                            status_code=401)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_, e):
        return JSONResponse({"detail": str(e)}, status_code=503)

    @app.exception_handler(EngineDead)
    async def _dead(_, e):
        # "engine_dead" tells the router to stop sending here, where a full engine's
        # 503 only says "try another or later"
        return JSONResponse({"detail": str(e), "engine_dead": True}, status_code=503)

    @app.exception_handler(TransferFailed)
    async def _unreachable(_, e):  # a source this worker could not reach or that refused
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

    if worker.role == "prefill":
        @app.post("/prefill")
        async def prefill(request: Request):
            result = await worker.prefill(await _body(request, PrefillRequest))
            if result.transfer is not None and await request.is_disconnected():
                # the router gave up while the prompt ran (its caller went away, or a
                # timeout): no decode worker will claim the lease, so it need not wait
                # to expire
                worker.abandon(result.transfer.lease)
            return JSONResponse(result.model_dump(mode="json"))

        @app.post("/peer_lost")
        async def peer_lost(request: Request):
            worker.peer_lost((await _body(request, PeerLost)).agent)
            return {"ok": True}

        @app.post("/abandon")
        async def abandon(request: Request):
            return {"freed": worker.abandon((await _body(request, Abandon)).lease)}
    else:
        @app.post("/sources")
        async def sources(request: Request):
            worker.register_sources((await _body(request, Sources)).addresses)
            return {"ok": True}

        channels = Channels()

        @app.get("/outputs")
        async def outputs():
            return StreamingResponse(channels.open().lines(), media_type="application/x-ndjson")

        @app.post("/decode")
        async def decode(request: Request):
            body = await _body(request, DecodeRequest)
            channel = channels.get(body.channel)
            stream, confirmed = await worker.decode(body)
            channel.start(body.request_id, stream, confirmed)
            return {"ok": True}

        @app.post("/abort")
        async def abort(request: Request):
            body = await _body(request, DecodeAbort)
            try:
                return {"aborted": channels.get(body.channel).abort(body.request_id)}
            except ValueError:  # the channel closed, which aborted its requests
                return {"aborted": False}

    return app

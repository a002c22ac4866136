"""The OpenAI-compatible HTTP app over any `Backend`.

    POST /v1/completions       prompt: text, texts, token ids or lists of token ids
    POST /v1/chat/completions  messages (and tools) through the tokenizer's chat template
    POST /tokenize, /detokenize
    GET  /v1/models, /health, /ping, /version, /metrics

A request is checked completely (body schema, then model-dependent limits)
before any of it reaches the backend, and all of its engine requests are
admitted before the answer starts, so errors are plain HTTP errors (400, 503)
and never a broken stream. A client that disconnects aborts its requests.
Bodies over `max_request_bytes` are refused (413) before they are read whole,
and prompts are tokenized on a worker thread, so a huge prompt stalls no other
stream and no health check. With `api_key`, the /v1 routes require
`Authorization: Bearer <api_key>` (401), as `vllm serve --api-key` does, and so do
/tokenize and /detokenize (which vLLM leaves open: they cost the server work).
"""

import contextlib
import importlib.metadata
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from serving.api import errors, render
from serving.api.backend import Backend
from serving.api.generate import (close_all, every, merged, start_timers, submit,
                                  until_disconnect)
from serving.api.metrics import CONTENT_TYPE, Metrics
from serving.api.prepare import (Limits, Prompt, ServerOptions, chat_jobs, chat_text,
                                 check_model, check_prompt, completion_jobs)
from serving.api.protocol import (ChatCompletionChunk, ChatCompletionRequest,
                                  ChatCompletionResponse, CompletionRequest, CompletionResponse,
                                  DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                  ModelCard, ModelList, TokenizeCompletionRequest,
                                  TokenizeRequest, TokenizeResponse, VersionResponse)
from serving.api.text import Tokenizer
from serving.body_limit import DEFAULT_MAX_BYTES, BodyLimit
from serving.secret import bearer_matches

_ERRORS = {400: {"model": ErrorResponse, "description": "Invalid request"},
           401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
           413: {"model": ErrorResponse, "description": "Request body too large"},
           500: {"model": ErrorResponse, "description": "The engine failed"},
           503: {"model": ErrorResponse, "description": "Overloaded: too many queued requests"}}


def _stream_doc(chunk) -> dict:
    return {200: {"description": f"JSON, or with `stream` server-sent events of "
                                 f"{chunk.__name__} ending in `data: [DONE]`",
                  "content": {"text/event-stream": {}}}}


class EventStream(EventSourceResponse):
    """Server-sent events (sse-starlette frames each item as a `data:` event, and sends a
    keep-alive comment every 15 s, which keeps proxies from cutting a stream whose first
    token waits behind a long queue) that always close their engine streams when the
    response ends, so the requests behind an interrupted stream are aborted at once,
    whichever way the ASGI server reports the disconnect (and even if the response never
    started)."""

    def __init__(self, events, streams):
        super().__init__(events, sep="\n")
        self.streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await close_all(self.streams)


def build_app(backend: Backend, tokenizer: Tokenizer, model_name: str, *,
              model_path: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_BYTES,
              options: ServerOptions = ServerOptions()) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        backend.shutdown()

    app = FastAPI(title="qwen35-jax OpenAI-compatible server",
                  description="vLLM-style OpenAI API over the qwen35-jax engine.",
                  lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, error=errors.error_body_of)
    async def authorised(request: Request) -> None:
        if api_key is not None and not bearer_matches(request.headers.get("authorization"),
                                                      api_key):
            raise errors.APIError("Unauthorized: a valid API key is required", status=401)

    keyed = [Depends(authorised)]
    limits = Limits(model_name=model_name, max_model_len=backend.max_model_len,
                    max_logprobs=backend.max_logprobs, vocab_size=tokenizer.vocab_size)
    metrics = Metrics(model_name, backend.stats, backend.max_model_len)
    app.state.backend, app.state.metrics, app.state.tokenizer = backend, metrics, tokenizer

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Healthy (empty body)"},
                        503: {"model": ErrorResponse, "description": "The engine stopped"}})
    async def health():
        """200 while the engine serves; 503 once it has stopped."""
        try:
            backend.check_health()
        except Exception as e:  # noqa: BLE001 -- any failure means unhealthy
            return errors.error_response(errors.APIError(str(e), status=503))
        return Response(status_code=200)

    probe = {"response_class": Response,
             "responses": {200: {"description": "Healthy (empty body)"},
                           503: {"model": ErrorResponse, "description": "The engine stopped"}}}

    @app.get("/ping", **probe)
    async def ping():
        """/health under the name load balancers of some platforms probe (vLLM's)."""
        return await health()

    @app.post("/ping", **probe)
    async def ping_post():
        """/ping by POST, as vLLM answers it too."""
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=importlib.metadata.version("qwen35-jax"))

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=keyed,
              responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        """A prompt's token ids, as /v1/completions or (with `messages`) as
        /v1/chat/completions would compute it."""
        check_model(body.model, limits)
        ids = await run_in_threadpool(_tokens, body)
        return TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids)

    def _tokens(body) -> list[int]:
        if isinstance(body, TokenizeCompletionRequest):
            return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        text = chat_text(body, tokenizer, add_generation_prompt=body.add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=keyed,
              responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, limits)
        check_prompt(Prompt(body.tokens), limits, "tokens")
        return DetokenizeResponse(prompt=await run_in_threadpool(tokenizer.decode, body.tokens))

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format",
                              "content": {CONTENT_TYPE.split(";")[0]: {}}}})
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, dependencies=keyed)
    async def models():
        return ModelList(data=[ModelCard(id=model_name, root=model_path or model_name,
                                         max_model_len=limits.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=keyed,
              responses={**_ERRORS, **_stream_doc(CompletionResponse)})
    async def completions(body: CompletionRequest, request: Request):
        start = time.perf_counter()
        jobs = await run_in_threadpool(completion_jobs, body, tokenizer, limits, options)
        renderer = render.StreamRenderer(False, f"cmpl-{uuid.uuid4().hex}", model_name, jobs,
                                         tokenizer, echo=body.echo, **_usage_options(body))
        return await _run(request, jobs, renderer, body.stream, start, echo=body.echo)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              dependencies=keyed, responses={**_ERRORS, **_stream_doc(ChatCompletionChunk)})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        start = time.perf_counter()
        jobs = await run_in_threadpool(chat_jobs, body, tokenizer, limits, options)
        renderer = render.StreamRenderer(True, f"chatcmpl-{uuid.uuid4().hex}", model_name, jobs,
                                         tokenizer, **_usage_options(body))
        return await _run(request, jobs, renderer, body.stream, start)

    async def _run(request: Request, jobs, renderer: render.StreamRenderer, stream: bool,
                   start: float, echo: bool = False):
        streams = await submit(backend, renderer.id, jobs, start_timers(metrics, jobs, start))
        outputs = merged(streams)
        if stream:
            return EventStream(_events(renderer, every(outputs, options.stream_interval)),
                               streams)
        try:
            finals = await until_disconnect(request, _collect(outputs, len(jobs)))
        finally:
            await close_all(streams)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        if renderer.chat:
            return render.chat_response(renderer.id, model_name, jobs, finals, tokenizer)
        return render.completion_response(renderer.id, model_name, jobs, finals, tokenizer,
                                          echo=echo)

    return app


def _usage_options(body) -> dict:
    o = body.stream_options
    return dict(include_usage=bool(o and o.include_usage),
                continuous_usage=bool(o and o.continuous_usage_stats))


async def _collect(outputs, n: int) -> list:
    finals = [None] * n
    async for i, out in outputs:
        if out.finished:
            finals[i] = out
    return finals


async def _events(renderer: render.StreamRenderer, outputs):
    try:
        for event in renderer.start():
            yield event
        async for i, out in outputs:
            for event in renderer.update(i, out):
                yield event
        for event in renderer.end():
            yield event
    except Exception as e:  # noqa: BLE001 -- the status line is sent: report in-band
        error = e if isinstance(e, errors.APIError) else errors.APIError(str(e), status=500)
        yield render.sse(error.body())
        yield render.DONE

"""An ASGI middleware that refuses request bodies over a size limit (413) before the app
reads them whole: by the declared ``Content-Length`` at once, or, for a body sent without
one, as soon as the bytes received pass the limit. A client cannot make a server hold or
parse more than the limit, whatever it sends.
"""

from __future__ import annotations

import json
from typing import Callable

from starlette.exceptions import HTTPException

DEFAULT_MAX_BYTES = 32 << 20  # a 262144-token prompt as JSON ids is about 2 MiB


class _TooLarge(HTTPException):
    """Raised from the body as the app reads it: an HTTPException, so that the app answers
    413 in its own error format (FastAPI answers 400 for any other error raised while it
    reads a body)."""

    def __init__(self, message: str):
        super().__init__(413, message)


class BodyLimit:
    """``app.add_middleware(BodyLimit, max_bytes=..., error=...)``; ``error(message,
    status)`` is the JSON body of the refusal (each server has its error format)."""

    def __init__(self, app, max_bytes: int, error: Callable[[str, int], dict]):
        self.app, self.max_bytes, self.error = app, max_bytes, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        message = f"request body over the limit of {self.max_bytes} bytes"
        try:
            if declared is not None and int(declared) > self.max_bytes:
                return await self._refuse(send, message)
        except ValueError:
            return await self._refuse(send, "bad Content-Length", status=400)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            m = await receive()
            if m["type"] == "http.request":
                seen += len(m.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(message)
            return m

        async def tracked(m):
            nonlocal started
            started = started or m["type"] == "http.response.start"
            await send(m)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(send, message)

    async def _refuse(self, send, message: str, status: int = 413) -> None:
        body = json.dumps(self.error(message, status)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

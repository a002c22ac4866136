"""Every error the server returns has OpenAI's shape:

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

`param` names the offending request field, and the message starts with it,
so a client can tell what to fix. FastAPI's own 422 validation answers and
Starlette's 404/405 are rewritten into this shape (400 for bad bodies).
"""

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)
# a union member with a validator of its own, as pydantic names it in an error's path
_VALIDATED = re.compile(r"^function-(?:after|before|wrap|plain)\[.*, (.+)\]$")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError",
          500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return error_body(self.message, self.param, self.status)


def error_body(message: str, param: str | None, status: int) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def error_body_of(message: str, status: int) -> dict:
    """An error body that names no field (for middleware, which sees no fields)."""
    return error_body(message, None, status)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """The problem pydantic found, named by its field path."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    # A union field fails once per member tried; a member's own validator (a value
    # error) says more than the other members' type mismatches.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [_VALIDATED.sub(r"\1", str(x)) for x in err.get("loc", ())
           if x != "body" and not str(x).startswith("body:")]  # a body's form (protocol)
    if err.get("type") == "json_invalid":
        return APIError(f"Invalid JSON: {err.get('msg')}")
    # A union's member appears in the path under its type name or tag ("list[str]",
    # "tokens"); kept, it says which reading of the field failed; param names the field.
    path = ".".join(loc)
    return APIError(f"{path or 'request body'}: {err.get('msg')}", param=loc[0] if loc else None)


def install(app: FastAPI) -> None:
    """Error handlers, and an OpenAPI document without FastAPI's 422 answers."""
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            for operations in default_openapi()["paths"].values():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return JSONResponse(error_body(str(exc.detail), None, exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal error: {exc!r}", status=500))

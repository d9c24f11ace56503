"""Errors in OpenAI's shape (Anthropic's on the /v1/messages routes: anthropic/errors.py).

Every failure the server reports, whatever raised it, reaches the client as

    {"error": {"message": "...", "type": "...", "param": "..." | null, "code": "..." | null}}

with a 4xx status for bad input and 5xx only for the server's own faults. FastAPI's
default `{"detail": ...}` body never escapes: `install_error_handlers` replaces the
handlers for validation errors, unknown routes and unexpected exceptions.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..anthropic.errors import MESSAGES_PREFIX, anthropic_error_body

logger = logging.getLogger(__name__)

# The `type` strings OpenAI uses, keyed by HTTP status.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def body_for(self, path: str) -> dict:
        """The error's body in the shape of the API at `path` (Anthropic's on
        /v1/messages, else OpenAI's)."""
        if path.startswith(MESSAGES_PREFIX):
            return anthropic_error_body(self.status_code, self.message)
        return self.body()

    def to_response(self, request: Request | None = None) -> JSONResponse:
        """The error as a response, in the shape of `request`'s API."""
        body = self.body() if request is None else self.body_for(request.url.path)
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status_code=400, param=param, code=code)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(f"The model '{name}' does not exist.", status_code=404,
                       param="model", code="model_not_found")


def format_loc(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (the path a client wrote)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type FastAPI knows through OpenAI's error shape."""

    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_response(request)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = tuple(p for p in first.get("loc", ()) if p != "body")
        return bad_request(str(first.get("msg")), format_loc(loc) or None).to_response(request)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Unknown endpoint: {request.method} {request.url.path}"
        error = OpenAIError(message, status_code=exc.status_code, headers=exc.headers)
        return error.to_response(request)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = OpenAIError("The server had an internal error while processing the request.",
                            status_code=500, type="server_error", code="internal_error")
        return error.to_response(request)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)

"""What a web page in the user's browser must not be able to do to a local server.

A page on any site can make the browser POST to http://127.0.0.1:8000 without a CORS
preflight when the body is a "simple" one (text/plain, a form), and, after pointing
its own domain at 127.0.0.1 (DNS rebinding), read the answers as same-origin. So,
before any route runs:

- a POST body must be JSON: `Content-Type: application/json` (any `+json` type, or
  none at all, as curl sends with `--data-binary`); anything else is a 415;
- on a loopback bind (127.0.0.1, ::1, localhost), the `Host` header must name the
  loopback too (any port) or one of `allowed_hosts`: a rebound domain is a 403.
  On other binds (0.0.0.0 in a container) any `Host` is served unless `allowed_hosts`
  lists the names to accept.

Before those, one check that is not the browser's: a request with more than
MAX_HEADERS headers is a 431 and its connection is closed (parsing and logging
thousands of headers per request is a cheap way to load a server). The headers' total
size is bounded below this, by the HTTP parser: past 16 KiB, uvicorn answers 400 and
closes the connection.

The app never redirects (no trailing-slash redirects), so no `Location` is built
from a client's `Host`.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import OpenAIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
MAX_HEADERS = 128
"""Headers one request may carry; browsers and SDKs send about 20, proxies add a few."""


def host_name(host_header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "[::1]")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


class BrowserSafety:
    """Pure ASGI middleware (no per-request Starlette objects: it sits on the path of
    every streamed token's connection, not of every token)."""

    def __init__(self, app: Any, bind_host: str, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = {h.lower() for h in allowed_hosts}
        loopback_bind = bind_host.lower() in LOOPBACK_NAMES
        self.allowed_names = (LOOPBACK_NAMES | self.allowed) if (loopback_bind or self.allowed) \
            else None                                     # None: any Host

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope["headers"]) > MAX_HEADERS:
            return await _refuse(send, scope, 431,
                                 f"The request has {len(scope['headers'])} headers; "
                                 f"this server takes at most {MAX_HEADERS}.",
                                 "too_many_headers", close=True)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"host", b"content-type")}
        if self.allowed_names is not None and \
                host_name(headers.get("host", "")) not in self.allowed_names:
            return await _refuse(send, scope, 403, "This server does not serve the host "
                                 f"{headers.get('host', '')!r}; start it with --allowed-hosts "
                                 "to add names.", "host_not_allowed")
        if scope["method"] == "POST" and not is_json_type(headers.get("content-type", "")):
            return await _refuse(send, scope, 415, "Request bodies must be JSON "
                                 "(Content-Type: application/json).", "unsupported_media_type")
        return await self.app(scope, receive, send)


async def _refuse(send: Any, scope: dict, status: int, message: str, code: str,
                  close: bool = False) -> None:
    """The refusal in the shape of the API the request was for (errors.py)."""
    error = OpenAIError(message, status_code=status, type="invalid_request_error", code=code)
    body = json.dumps(error.body_for(scope.get("path", ""))).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})

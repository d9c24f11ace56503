"""API keys: who may call the server.

With `api_key` set (one key or several, from the config file, `KVSERVE_API_KEY` or
`--api-key`), every route except the `open_paths` (by default /health, /ready and
/metrics, which probes and scrapers call without credentials) needs

    Authorization: Bearer <key>      (the OpenAI SDK's `OpenAI(api_key=...)`)
    x-api-key: <key>                 (the Anthropic SDK's `Anthropic(api_key=...)`)

either on any route, so one key setting serves both kinds of client. A missing or
wrong key is a 401 in the route's error shape.

The comparison runs in constant time, so response timing says nothing about how
much of a guessed key was right: `secrets.compare_digest` on every configured key,
with no early exit when one matches.
"""

from __future__ import annotations

import secrets

from fastapi import Request

from .errors import OpenAIError


def key_matches(token: str, keys: list[str]) -> bool:
    """True when `token` equals one of `keys`, in time independent of the contents."""
    candidate = token.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        # `|` and not `or`: every key is compared, whatever the earlier results.
        matched |= secrets.compare_digest(candidate, key.encode("utf-8"))
    return matched


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def presented_key(request: Request) -> str | None:
    """The key the caller sent (Bearer first, then x-api-key), or None."""
    token = bearer_token(request)
    return token if token is not None else request.headers.get("x-api-key")


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of every route: raise 401 unless the caller may pass.
    (async: FastAPI runs a plain function dependency on a worker thread, a thread
    hop per request for a few comparisons.)"""
    settings = request.app.state.serving.settings
    if settings.api_key is None or request.url.path in settings.open_paths:
        return
    token = presented_key(request)
    if token is None or not key_matches(token, settings.api_key):
        raise OpenAIError("Incorrect or missing API key. Send 'Authorization: Bearer <key>' "
                          "or 'x-api-key: <key>'.", status_code=401, code="invalid_api_key")

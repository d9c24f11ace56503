"""Server-sent events the way OpenAI streams them.

    data: {"id": "chatcmpl-...", "object": "chat.completion.chunk", ...}\\n\\n
    ...
    data: [DONE]\\n\\n

Each chunk is one `data:` event; the stream ends with the literal `[DONE]`. An error
after the stream has started cannot change the HTTP status any more, so it is sent
in-band as an event whose data is OpenAI's error object (the OpenAI SDK raises it).

EventStreamResponse is a plain ASGI response: each event goes out as one body message,
with no per-event wrapper around `send`: a cancel scope per event would cost the
event loop CPU time on every token of every stream.
Per response it runs three helper tasks: one waits for the client's disconnect, which
cancels the stream (the generator's cleanup cancels the engine requests), one sends a
comment line every PING_INTERVAL_S, so proxies keep an idle stream open (a request
still queued, a long prefill), and one watches the sends: a client that stops
reading fills the socket's buffers until a send blocks, and once one has blocked for
`write_timeout_s` the stream is cancelled like a disconnect (its blocks freed). A shutdown does not cut streams: the drain
(lifecycle.py, generation.py's drain deadline) ends them in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import OpenAIError
from ..generation import wait_for_disconnect

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 15
DONE = {"data": "[DONE]"}
PING = b": ping\n\n"
HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any], name: str | None = None) -> dict[str, str]:
    """One event: `payload` as compact JSON, under the event `name` when given (the
    Responses API names every event; chat and completions name none)."""
    data = {"data": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}
    return data if name is None else {"event": name, **data}


TEXT_SLOT = "\ue000kvserve-text\ue000"
"""Stands for the text in a template (a private-use character: no model says it, no
header holds it)."""


class TextEvents:
    """Events of chunks that differ only in one choice's text: each choice's chunk is
    rendered once by `payload(index, TEXT_SLOT)` and split at the slot, so a token's
    event costs one string escape instead of a whole JSON encoding. The events are
    byte for byte those of `event(payload(index, text))`."""

    def __init__(self, payload: Callable[[int, str], dict[str, Any]]) -> None:
        self._payload = payload
        self._templates: dict[int, list[str]] = {}

    def __call__(self, index: int, text: str) -> dict[str, str]:
        parts = self._templates.get(index)
        if parts is None:
            slot = json.dumps(TEXT_SLOT, ensure_ascii=False)
            template = event(self._payload(index, TEXT_SLOT))["data"]
            parts = self._templates[index] = template.split(slot)
        if len(parts) != 2:          # the slot twice (or not at all): encode it whole
            return event(self._payload(index, text))
        return {"data": parts[0] + json.encoder.encode_basestring(text) + parts[1]}


def encode(item: dict[str, str]) -> bytes:
    """One event's wire form; `data` never holds a newline (compact JSON or [DONE])."""
    data = b"data: " + item["data"].encode() + b"\n\n"
    name = item.get("event")
    return data if name is None else b"event: " + name.encode() + b"\n" + data


async def _guarded(events: AsyncIterator[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
    """Forward `events`; turn an exception into an in-band error event + [DONE]."""
    try:
        async for item in events:
            yield item
    except OpenAIError as exc:
        yield event(exc.body())
        yield DONE
    except Exception:
        logger.exception("stream failed")
        error = OpenAIError("The server had an internal error while streaming.",
                            status_code=500, type="server_error", code="internal_error")
        yield event(error.body())
        yield DONE


class EventStreamResponse(StreamingResponse):
    """Streams `events` as SSE; `on_close` runs on the event loop once the stream is
    over, however it ended (finished, client gone, cancelled). Starlette's
    StreamingResponse gives the headers (no Content-Length); the sending is its own."""

    def __init__(self, events: AsyncIterator[dict[str, str]], on_close: Callable[[], None],
                 ping_interval_s: float = PING_INTERVAL_S,
                 write_timeout_s: float | None = None) -> None:
        super().__init__(events, headers=HEADERS, media_type="text/event-stream")
        self._on_close = on_close
        self._ping_interval_s = ping_interval_s
        self._write_timeout_s = write_timeout_s
        self._send_started: float | None = None
        """Loop time at which the send in progress began (None between sends)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tasks = [asyncio.create_task(self._send_events(send)),
                 asyncio.create_task(wait_for_disconnect(receive))]
        if self._write_timeout_s is not None:
            tasks.append(asyncio.create_task(self._watch_sends()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            self._on_close()
        error = results[0]
        if isinstance(error, BaseException) and not isinstance(
                error, (asyncio.CancelledError, OSError)):    # OSError: the client went away
            raise error

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        pinger = asyncio.create_task(self._ping(send))
        try:
            loop = asyncio.get_running_loop()
            async with contextlib.aclosing(self.body_iterator) as events:
                async for item in events:
                    self._send_started = loop.time()
                    await send({"type": "http.response.body", "body": encode(item),
                                "more_body": True})
                    self._send_started = None
            pinger.cancel()                 # no ping after the last message
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            pinger.cancel()

    async def _watch_sends(self) -> None:
        """Return once a send has been blocked for write_timeout_s (a client that
        reads nothing); that ends the response like a disconnect."""
        loop = asyncio.get_running_loop()
        period = min(1.0, self._write_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            started = self._send_started
            if started is not None and loop.time() - started >= self._write_timeout_s:
                logger.warning("cancelling a stream whose client read nothing for %gs",
                               self._write_timeout_s)
                return

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(self._ping_interval_s)
            await send({"type": "http.response.body", "body": PING, "more_body": True})


def sse_response(events: AsyncIterator[dict[str, str]], on_close: Callable[[], None],
                 write_timeout_s: float | None = None) -> EventStreamResponse:
    """Stream `events` (an exception becomes an in-band error event and [DONE]). When
    the client disconnects, the stream is cancelled, whose cleanup cancels the engine
    requests; `on_close` runs after the stream in every case, covering a client gone
    before the generator even started."""
    return EventStreamResponse(_guarded(events), on_close, write_timeout_s=write_timeout_s)

"""Server-sent events the way OpenAI streams them.

    data: {"id": "chatcmpl-...", "object": "chat.completion.chunk", ...}\\n\\n
    ...
    data: [DONE]\\n\\n

Each chunk is one `data:` event; the stream ends with the literal `[DONE]`. An error
after the stream has started cannot change the HTTP status any more, so it is sent
in-band as an event whose data is OpenAI's error object (the OpenAI SDK raises it).
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from .errors import OpenAIError

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 15
DONE = {"data": "[DONE]"}


def event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False, separators=(",", ":"))}


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


def sse_response(events: AsyncIterator[dict[str, str]], on_close: Callable[[], None],
                 drain_s: float) -> EventSourceResponse:
    """Stream `events`. When the client disconnects, sse-starlette cancels the
    generator, whose cleanup cancels the engine requests; `on_close` runs after the
    stream in every case, covering a client gone before the generator even started.

    On server shutdown sse-starlette would cut every stream at once; with a grace
    period of `drain_s` a stream in flight may finish first (see lifecycle.py)."""
    async def close() -> None:      # on the event loop: a plain function would get a thread
        on_close()

    return EventSourceResponse(_guarded(events), ping=PING_INTERVAL_S, sep="\n",
                               background=BackgroundTask(close),
                               shutdown_grace_period=drain_s)

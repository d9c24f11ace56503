"""One structured log line per HTTP request.

    INFO:  request id=chatcmpl-1f3e... method=POST path=/v1/chat/completions status=200
           stream=true prompt_tokens=31 completion_tokens=16 ttft_ms=84.2
           latency_ms=912.7 finish_reason=length

(one line in the log; key=value pairs, "logfmt", so log tools can index them). Every
request gets its line, refused ones too; a streamed response is logged when the
stream ends, so the line carries its real length and outcome. Prompt and output
text appear only with `log_prompts: true`: they may hold anything users type.

`RequestLogMiddleware` creates a `RequestRecord` when the request arrives and puts it
on `request.state.record`; the generation code fills it in; the middleware writes
the line once the response is over.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("kvserve.requests")
# Probes and scrapers call these every few seconds: their lines go to DEBUG.
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass
class RequestRecord:
    """What the log line of one request says, filled in while the request runs."""

    method: str
    path: str
    arrival: float = field(default_factory=time.perf_counter)
    """perf_counter when the request reached the server (the engine uses the same clock)."""
    request_id: str | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_time: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error_code: str | None = None
    """Set when generation failed after the response had started (streams)."""
    prompt_text: str | None = None
    output_texts: dict[int, list[str]] = field(default_factory=dict)
    draft_tokens: int = 0
    """Speculative decoding: draft tokens judged over the request's choices, and kept."""
    accepted_tokens: int = 0

    def add_output_text(self, index: int, text: str) -> None:
        self.output_texts.setdefault(index, []).append(text)

    def fields(self, status: int, log_prompts: bool) -> dict[str, Any]:
        """The key=value pairs of the line, in order; absent values are left out."""
        now = time.perf_counter()
        ttft = None
        if self.first_token_time is not None:
            ttft = round((self.first_token_time - self.arrival) * 1000, 1)
        values: dict[str, Any] = {
            "id": self.request_id, "method": self.method, "path": self.path,
            "status": status, "stream": self.stream, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "ttft_ms": ttft,
            "latency_ms": round((now - self.arrival) * 1000, 1),
            "finish_reason": ",".join(self.finish_reasons) or None, "error": self.error_code,
            "spec_acceptance": (round(self.accepted_tokens / self.draft_tokens, 3)
                                if self.draft_tokens else None),
        }
        if log_prompts:
            values["prompt"] = self.prompt_text
            values["output"] = ["".join(self.output_texts[i]) for i in sorted(self.output_texts)]
        return {k: v for k, v in values.items() if v is not None}


def format_logfmt(values: dict[str, Any]) -> str:
    """{"a": 1, "b": "x y"} -> 'a=1 b="x y"'. Strings with spaces, quotes or '=' are
    JSON-quoted, so every line splits back into the same pairs."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = str(value)
        elif isinstance(value, str) and value and not any(c in value for c in ' "=\\\n\t'):
            text = value
        else:
            text = json.dumps(value, ensure_ascii=False)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def request_record(request: Any) -> RequestRecord:
    """The record of `request` (a fresh one when no middleware made it, e.g. tests)."""
    record = getattr(request.state, "record", None)
    if record is None:
        record = RequestRecord(request.method, request.url.path)
        request.state.record = record
    return record


class RequestLogMiddleware:
    """Pure ASGI middleware (it must not buffer streamed bodies): times the request,
    remembers the response status and logs the line when the app is done."""

    def __init__(self, app: ASGIApp, log_prompts: bool = False) -> None:
        self.app = app
        self.log_prompts = log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = record
        status = 500  # what the client sees if the app fails before responding

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            level = logging.DEBUG if record.path in QUIET_PATHS else logging.INFO
            if logger.isEnabledFor(level):
                line = format_logfmt(record.fields(status, self.log_prompts))
                logger.log(level, "request %s", line)

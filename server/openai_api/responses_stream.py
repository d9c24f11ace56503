"""The event stream of POST /v1/responses with `stream: true`.

    event: response.created                 the response, in_progress, no output
    event: response.in_progress
    per item, in the order the model writes them:
      message:   response.output_item.added, response.content_part.added,
                 response.output_text.delta (one per text delta),
                 response.output_text.done, response.content_part.done,
                 response.output_item.done
      reasoning: the same with response.reasoning_text.delta / .done
      call:      response.output_item.added, response.function_call_arguments.delta,
                 response.function_call_arguments.done, response.output_item.done
    event: response.completed               (or response.incomplete) the whole response

Every event's data carries its `type` and a `sequence_number` counting from 0; the
item events carry `output_index` (the item's place in `output`), and the part and
delta events `item_id` and `content_index`. There is no `[DONE]`: the last event
ends the stream. A failure once the stream has started cannot change the status any
more: it goes out as an `error` event followed by `response.failed`.

`ResponseEvents` turns the chat path's streamed deltas (chat_answer.AnswerStream:
`content`, `reasoning_content`, `tool_calls`) into these events, each named by its
type (OpenAI's `event:` line before its `data:` line, sse.encode).
"""

from __future__ import annotations

import logging
from typing import Any

from ..edge.errors import OpenAIError
from .responses_output import (failed, finished, function_call_item, item_id, message_item,
                               output_text_part, reasoning_item, reasoning_text_part)
from ..edge.sse import event

logger = logging.getLogger(__name__)

_KINDS = {
    # kind: (item id prefix, item factory, part factory, delta/done event prefix)
    "message": ("msg", message_item, output_text_part, "response.output_text"),
    "reasoning": ("rs", reasoning_item, reasoning_text_part, "response.reasoning_text"),
}


class ResponseEvents:
    """The events of one streamed response, built as its deltas come."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.open: dict[str, Any] | None = None
        """The item being written: {"kind", "id", "index", "text"} or a call's."""

    def _event(self, type_: str, **fields: Any) -> dict[str, str]:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event(payload, name=type_)

    def start(self) -> list[dict[str, str]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, str]]:
        """One chat delta: content, reasoning_content or a tool call (announced
        whole with empty arguments, then its arguments)."""
        if delta.get("content"):
            return self._text("message", delta["content"])
        if delta.get("reasoning_content"):
            return self._text("reasoning", delta["reasoning_content"])
        events = []
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self._open_call(call)
            elif self.open is not None and self.open["kind"] == "call":
                arguments = call["function"]["arguments"]
                self.open["item"]["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self.open["id"],
                                          output_index=self.open["index"], delta=arguments))
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, str]]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            events += self.close("completed")
            events += self._open_text(kind)
        self.open["text"].append(text)
        events.append(self._event(f"{_KINDS[kind][3]}.delta", item_id=self.open["id"],
                                  output_index=self.open["index"], content_index=0,
                                  delta=text, **({"logprobs": []} if kind == "message"
                                                 else {})))
        return events

    def _open_text(self, kind: str) -> list[dict[str, str]]:
        prefix, item, part, _ = _KINDS[kind]
        self.open = {"kind": kind, "id": item_id(prefix), "index": len(self.output),
                     "text": []}
        where = {"output_index": self.open["index"]}
        return [self._event("response.output_item.added", **where,
                            item=item(self.open["id"], None, "in_progress")),
                self._event("response.content_part.added", item_id=self.open["id"], **where,
                            content_index=0, part=part(""))]

    def _open_call(self, call: dict[str, Any]) -> list[dict[str, str]]:
        events = self.close("completed")
        item = function_call_item(item_id("fc"), call["id"], call["function"]["name"], "",
                                  "in_progress")
        self.open = {"kind": "call", "id": item["id"], "index": len(self.output), "item": item}
        return events + [self._event("response.output_item.added",
                                     output_index=self.open["index"], item=dict(item))]

    def close(self, status: str) -> list[dict[str, str]]:
        """Finish the open item (if any) with `status`; it joins the output."""
        current, self.open = self.open, None
        if current is None:
            return []
        where = {"item_id": current["id"], "output_index": current["index"]}
        if current["kind"] == "call":
            item = {**current["item"], "status": status}
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"])]
        else:
            _, make_item, make_part, prefix = _KINDS[current["kind"]]
            text = "".join(current["text"])
            item = make_item(current["id"], text, status)
            extra = {"logprobs": []} if current["kind"] == "message" else {}
            events = [self._event(f"{prefix}.done", **where, content_index=0, text=text,
                                  **extra),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=make_part(text))]
        self.output.append(item)
        return events + [self._event("response.output_item.done",
                                     output_index=current["index"], item=item)]

    def finish(self, incomplete: bool, usage: dict[str, Any]) -> list[dict[str, str]]:
        """Close the last item and send the whole response. A plain answer that wrote
        nothing still gets its (empty) message item, as the whole response has."""
        status = "incomplete" if incomplete else "completed"
        events = self.close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._open_text("message") + self.close(status)
        done = finished(self.response, self.output, incomplete, usage)
        return events + [self._event(f"response.{done['status']}", response=done)]

    def fail(self, error: OpenAIError) -> list[dict[str, str]]:
        """The open item closed as incomplete, the error, and the failed response."""
        events = self.close("incomplete")
        return events + [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed",
                        response=failed(self.response, self.output, error.message))]


def internal_error() -> OpenAIError:
    logger.exception("response stream failed")
    return OpenAIError("The server had an internal error while streaming.", status_code=500,
                       type="server_error", code="internal_error")

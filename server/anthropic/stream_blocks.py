"""A streamed chat answer's deltas as Anthropic's content-block events.

AnswerStream (chat_answer.py) turns the model's text into OpenAI deltas:
`{"reasoning_content": ...}`, `{"content": ...}`, and per tool call one delta with its
id and name, then one with its arguments. Anthropic streams blocks instead, one open
at a time, each opened with its kind and closed before the next:

    {"reasoning_content": "Hm"}  -> content_block_start thinking (index 0), thinking_delta
    {"content": "Sure."}         -> content_block_stop 0, content_block_start text (1), text_delta
    {"tool_calls": [{id, name}]} -> content_block_stop 1, content_block_start tool_use (2)
    {"tool_calls": [{arguments}]}-> input_json_delta (partial_json: the arguments)
    close()                      -> content_block_stop 2
"""

from __future__ import annotations

from typing import Any

from ..edge.sse import event


class BlockEvents:
    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        """The open block's type, or None."""

    def feed(self, delta: dict[str, Any]) -> list[dict[str, str]]:
        if "reasoning_content" in delta:
            return self._into("thinking", {"thinking": ""},
                              {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if "content" in delta:
            return self._into("text", {"text": ""}, {"type": "text_delta", "text": delta["content"]})
        call = delta["tool_calls"][0]
        if "id" in call:           # a new call: its own block
            return self._close() + self._open("tool_use", {
                "id": call["id"], "name": call["function"]["name"], "input": {}})
        return [self._delta({"type": "input_json_delta",
                             "partial_json": call["function"]["arguments"]})]

    def close(self) -> list[dict[str, str]]:
        return self._close()

    def _into(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[dict[str, str]]:
        events = [] if self.kind == kind else self._close() + self._open(kind, start)
        return events + [self._delta(delta)]

    def _open(self, kind: str, fields: dict[str, Any]) -> list[dict[str, str]]:
        self.index += 1
        self.kind = kind
        return [event({"type": "content_block_start", "index": self.index,
                       "content_block": {"type": kind, **fields}}, "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> dict[str, str]:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta},
                     "content_block_delta")

    def _close(self) -> list[dict[str, str]]:
        if self.kind is None:
            return []
        self.kind = None
        return [event({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

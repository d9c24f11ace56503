"""Tool calls out of a streamed answer: text deltas in, content deltas and whole
calls out, per choice.

    feed(text)  -> [("content", text) | ("call", ParsedCall), ...]
    finish()    -> what was held back, parsed

Content streams as it comes; text that may be the start of a call (a partial
`<tool_call>` tag, a generic envelope's first bytes) is held back until it is known.
A call is emitted once it is complete, arguments whole: OpenAI's stream shape allows
the arguments in one delta, and a complete call is the only kind that surely parses.
"""

from __future__ import annotations

import json

from .tool_formats import GenericFormat, HermesFormat, ParsedCall, ParsedOutput

Event = tuple[str, "str | ParsedCall"]

_CONTENT_START = '{"content":"'
_CALLS_START = '{"tool_calls":'


def _events(parsed: ParsedOutput) -> list[Event]:
    events: list[Event] = [("content", parsed.content)] if parsed.content else []
    return events + [("call", call) for call in parsed.calls]


class MarkerParser:
    """Content until a call may start (a marker: Mistral's [TOOL_CALLS]), then
    everything is held and parsed with `tool_format` when the answer ends. With
    `leading` (Llama 3's bare JSON calls) a call can only be the whole answer: its
    first non-blank text decides."""

    def __init__(self, tool_format, markers: tuple[str, ...], leading: bool = False) -> None:
        self.format = tool_format
        self.markers = markers
        self.leading = leading
        self.held = ""
        self.holding = False
        self.decided = False          # leading: the first non-blank text was seen

    def feed(self, text: str) -> list[Event]:
        pending = self.held + text
        if self.holding:
            self.held = pending
            return []
        if self.leading:
            return self._feed_leading(pending)
        start = min((i for i in (pending.find(m) for m in self.markers) if i >= 0), default=-1)
        if start >= 0:
            self.holding, self.held = True, pending[start:]
            return [("content", pending[:start])] if pending[:start] else []
        keep = _partial_marker(pending, self.markers)
        self.held, out = pending[len(pending) - keep:], pending[:len(pending) - keep]
        return [("content", out)] if out else []

    def _feed_leading(self, pending: str) -> list[Event]:
        if self.decided:
            return [("content", pending)] if pending else []
        stripped = pending.lstrip()
        if not stripped or any(m.startswith(stripped) for m in self.markers):
            self.held = pending               # blank, or a marker's start: undecided
            return []
        self.decided = True
        if any(stripped.startswith(m) for m in self.markers):
            self.holding, self.held = True, pending
            return []
        self.held = ""
        return [("content", pending)]

    def finish(self) -> list[Event]:
        held, self.held = self.held, ""
        if not held:
            return []
        return _events(self.format.parse(held)) if self.holding else [("content", held)]


class HermesParser:
    """Content around <tool_call> blocks; each block becomes a call when it closes."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    return events
                block = self.buffer[:end + len(self.CLOSE)]
                self.buffer, self.in_call = self.buffer[end + len(self.CLOSE):], False
                events += _events(HermesFormat().parse(self.OPEN + block))
                continue
            start = self.buffer.find(self.OPEN)
            if start >= 0:
                if self.buffer[:start]:
                    events.append(("content", self.buffer[:start]))
                self.buffer, self.in_call = self.buffer[start + len(self.OPEN):], True
                continue
            keep = _partial_marker(self.buffer, (self.OPEN,))
            out = self.buffer[:len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return events + ([("content", out)] if out else [])

    def finish(self) -> list[Event]:
        rest, self.buffer = (self.OPEN if self.in_call else "") + self.buffer, ""
        return [("content", rest)] if rest else []


class GenericParser:
    """The JSON envelope: {"content": "..."} streams its string as it is decoded;
    {"tool_calls": [...]} is parsed when the answer ends."""

    def __init__(self) -> None:
        self.raw = ""
        self.sent = 0            # characters of the decoded content already emitted
        self.branch: str | None = None

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        if self.branch is None:
            for start, branch in ((_CONTENT_START, "content"), (_CALLS_START, "calls")):
                if self.raw.startswith(start):
                    self.branch = branch
            if self.branch is None and not (_CONTENT_START.startswith(self.raw)
                                            or _CALLS_START.startswith(self.raw)):
                self.branch = "other"
        if self.branch != "content":
            return []
        decoded = _decoded_prefix(self.raw[len(_CONTENT_START):])
        out, self.sent = decoded[self.sent:], len(decoded)
        return [("content", out)] if out else []

    def finish(self) -> list[Event]:
        if self.branch == "content":
            parsed = GenericFormat().parse(self.raw)
            rest = (parsed.content or "")[self.sent:] if not parsed.calls else ""
            return [("content", rest)] if rest else []
        return _events(GenericFormat().parse(self.raw)) if self.raw else []


def _decoded_prefix(raw: str) -> str:
    """The longest decodable start of a JSON string's body (no closing quote yet, or
    a complete one followed by the envelope's end)."""
    escaped, end = False, len(raw)
    for index, char in enumerate(raw):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            end = index
            break
    for cut in range(end, max(end - 12, -1), -1):
        try:
            return json.loads('"' + raw[:cut] + '"')
        except ValueError:
            continue
    return ""


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `markers`."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                best = max(best, size)
                break
    return best


def stream_parser(tool_format):
    if tool_format.name == "generic":
        return GenericParser()
    if tool_format.name == "hermes":
        return HermesParser()
    if tool_format.name == "mistral":
        return MarkerParser(tool_format, (tool_format.marker,))
    return MarkerParser(tool_format, ("{", "<|python_tag|>"), leading=True)

"""Thinking apart from answering: `<think>...</think>` (Qwen3, DeepSeek-R1 distills).

A model whose chat template knows `<think>` writes its reasoning first; the server
returns it as `message.reasoning_content` (streamed as `delta.reasoning_content`)
and the rest as `content`, vLLM's field names. The block may be opened by the model
(Qwen3) or by the prompt itself (templates whose generation prompt ends with
`<think>`: then the answer starts inside the block). An answer that never closes
the block is all reasoning.

Under `response_format` or a tool choice, the grammar lets the thinking run free and
constrains what follows `</think>` (`after_thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.structured.grammar import GrammarSpec

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    opened_by_prompt: bool
    """The rendered prompt ends inside a think block."""

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer."""
        body = text
        if not self.opened_by_prompt:
            stripped = text.lstrip()
            if not stripped.startswith(OPEN):
                return None, text
            body = stripped[len(OPEN):]
        reasoning, closed, content = body.partition(CLOSE)
        if not closed:
            return reasoning.strip() or None, ""
        return reasoning.strip(), content.lstrip()

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.opened_by_prompt)


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The generation prompt leaves a think block open (its last tag is <think>)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningStream:
    """Streamed answers: feed(text) -> [("reasoning" | "content", text), ...]; tags
    split across deltas are held back until they are known."""

    def __init__(self, opened_by_prompt: bool) -> None:
        self.state = "reasoning" if opened_by_prompt else "start"
        self.held = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        pending, self.held = self.held + text, ""
        if self.state == "start":
            stripped = pending.lstrip()
            if not stripped or OPEN.startswith(stripped):
                self.held = pending
                return []
            if not stripped.startswith(OPEN):
                self.state = "content"
                return [("content", pending)]
            self.state, pending = "reasoning", stripped[len(OPEN):]
        if self.state == "after":            # blanks right after </think> are dropped
            pending = pending.lstrip()
            if pending:
                self.state = "content"
        if self.state in ("content", "after"):
            return [("content", pending)] if pending else []
        end = pending.find(CLOSE)
        if end >= 0:
            self.state = "after"
            out = [("reasoning", pending[:end])] if pending[:end] else []
            rest = pending[end + len(CLOSE):].lstrip()
            if rest:
                self.state = "content"
                out.append(("content", rest))
            return out
        keep = next((n for n in range(min(len(CLOSE) - 1, len(pending)), 0, -1)
                     if CLOSE.startswith(pending[-n:])), 0)
        self.held = pending[len(pending) - keep:]
        out = pending[:len(pending) - keep]
        return [("reasoning", out)] if out else []

    def finish(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        if not held:
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


def after_thinking(spec: GrammarSpec, opened_by_prompt: bool) -> GrammarSpec:
    """`spec` applied to what follows the think block (free thinking first)."""
    if spec.kind == "lark":
        answer = spec.value.replace("start:", "answer:", 1)
    elif spec.kind == "regex":
        answer = "answer: /" + spec.value.replace("/", "\\/") + "/\n"
    else:
        schema = {"type": "object"} if spec.kind == "json_object" else spec.value
        schema = json.loads(schema) if isinstance(schema, str) else schema
        compact = {**schema, "x-guidance": {"whitespace_flexible": False}} \
            if isinstance(schema, dict) else schema
        answer = f"answer: %json {json.dumps(compact)}\n"
    opener = "" if opened_by_prompt else '"<think>" '
    return GrammarSpec("lark", f'start: {opener}think /[ \\n]*/ answer\n'
                               f'think[stop="{CLOSE}"]: /(?s:.*)/\n{answer}',
                       closing_hints=(CLOSE,))

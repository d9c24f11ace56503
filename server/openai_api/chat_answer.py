"""What one chat request's answers are made of, decided once per request:

    thinking    a ReasoningSplit when the model thinks first (reasoning.py), else None
    tools       the tool-call family when tools are offered (tool_formats.py), else None

and from it the grammar the engine enforces (`grammar_spec`), the message of a whole
answer (`message`) and the deltas of a streamed one (`AnswerStream`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.structured.grammar import GrammarSpec

from ..protocol.chat import ChatCompletionRequest
from ..text_pipeline.reasoning import CLOSE, ReasoningSplit, after_thinking, prompt_opens_thinking
from ..state import ServingState
from ..text_pipeline.structured_output import grammar_spec as response_format_spec
from ..text_pipeline.tool_stream import stream_parser


@dataclass(frozen=True)
class AnswerShape:
    thinking: ReasoningSplit | None
    tools: Any
    """The tool format when tools are offered (tool_choice is not 'none')."""

    @classmethod
    def of(cls, body: ChatCompletionRequest, state: ServingState, prompt_text: str
           ) -> "AnswerShape":
        thinking = None
        if state.chat_format.reasoning and not prompt_text.rstrip().endswith(CLOSE):
            thinking = ReasoningSplit(prompt_opens_thinking(prompt_text))
        return cls(thinking, state.chat_format.tools if body.calls_tools else None)

    def grammar_spec(self, body: ChatCompletionRequest) -> GrammarSpec | None:
        if self.tools is not None:
            spec = self.tools.grammar(body.tools, body.tool_choice or "auto",
                                      body.parallel_tool_calls is not False)
        else:
            spec = response_format_spec(body.response_format)
        if spec is not None and self.thinking is not None:
            spec = after_thinking(spec, self.thinking.opened_by_prompt)
        return spec

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a whole answer, and whether it calls tools."""
        reasoning, content = (None, text) if self.thinking is None else self.thinking.split(text)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None,
                                   "tool_calls": []}
        if self.thinking is not None:
            message["reasoning_content"] = reasoning
        if self.tools is not None:
            parsed = self.tools.parse(content)
            message["content"] = parsed.content
            message["tool_calls"] = [call.to_openai() for call in parsed.calls]
        return message, bool(message["tool_calls"])

    def stream(self) -> "AnswerStream":
        return AnswerStream(self)


@dataclass
class AnswerStream:
    """Text deltas in, OpenAI delta objects out (content, reasoning_content,
    tool_calls), per choice."""

    shape: AnswerShape
    num_calls: int = 0
    _thinking: Any = None
    _tools: Any = None
    _plain: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.shape.thinking is not None:
            self._thinking = self.shape.thinking.stream()
        if self.shape.tools is not None:
            self._tools = stream_parser(self.shape.tools)
        self._plain = self._thinking is None and self._tools is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._plain:
            return [{"content": text}] if text else []
        parts = self._thinking.feed(text) if self._thinking else [("content", text)]
        return self._deltas(parts, finishing=False)

    def step(self, delta) -> list[dict[str, Any]]:
        """The deltas of one ChoiceDelta: its text fed, then the finish when it ends."""
        parts = self.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            parts += self.finish()
        return parts

    def finish(self) -> list[dict[str, Any]]:
        if self._plain:
            return []
        parts = self._thinking.finish() if self._thinking else []
        return self._deltas(parts, finishing=True)

    def _deltas(self, parts: list[tuple[str, str]], finishing: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                deltas.append({"reasoning_content": text})
            elif self._tools is None:
                deltas.append({"content": text})
            else:
                deltas += self._tool_deltas(self._tools.feed(text))
        if finishing and self._tools is not None:
            deltas += self._tool_deltas(self._tools.finish())
        return deltas

    def _tool_deltas(self, events) -> list[dict[str, Any]]:
        deltas = []
        for kind, value in events:
            if kind == "content":
                if value:
                    deltas.append({"content": value})
                continue
            call = value.to_openai(self.num_calls)
            arguments = call["function"]["arguments"]
            call["function"]["arguments"] = ""
            deltas.append({"tool_calls": [call]})
            deltas.append({"tool_calls": [{"index": self.num_calls,
                                           "function": {"arguments": arguments}}]})
            self.num_calls += 1
        return deltas

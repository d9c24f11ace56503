"""Schema of POST /v1/chat/completions.

Messages carry a role (system, developer, user, assistant or tool) and content that
is either a string or a list of `{"type": "text", "text": ...}` parts; the parts are
joined into one string before the chat template sees them. Other part types (images,
audio) are refused by name. An assistant message may carry `tool_calls` (a tool loop's
history); a tool message answers one by `tool_call_id`. Other fields an SDK writes
back when a client replays an assistant message (`refusal`, `audio`, ...) are accepted
while empty, refused once they carry data. `developer` is the SDK's name for system
instructions to newer models: the template sees it as `system`.

`tools`, `tool_choice` and `parallel_tool_calls` follow OpenAI's function calling
(server/tool_calls.py); `chat_template_kwargs` reaches the chat template (e.g.
`{"enable_thinking": false}`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .common import MAX_TOP_LOGPROBS, GenerationFields, OpenAIModel

# Keys of an assistant message the OpenAI SDK echoes back; null/empty is harmless.
_ECHOED_EMPTY_FIELDS = ("refusal", "function_call", "audio", "annotations")
_FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema; none means an object with any properties."""
        return self.parameters if self.parameters else {"type": "object"}


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def to_template_dict(self) -> dict[str, Any]:
        """Templates index arguments as an object (Qwen's writes `arguments | tojson`)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def join_text_parts(value: Any, text_types: tuple[str, ...] = ("text",),
                    strict_fields: bool = True) -> str:
    """Content as one string: a string as is, parts of `text_types` concatenated.
    `strict_fields`: a part's keys besides type and text are an error (chat's text
    parts), else ignored (the annotations and logprobs a replayed Responses output
    part carries)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for index, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {index} must be an object")
        kind = part.get("type")
        if kind not in text_types:
            named = ", ".join(repr(t) for t in text_types)
            raise ValueError(f"part {index} has unsupported type {kind!r}; only text parts "
                             f"({named}) are supported")
        extra = set(part) - {"type", "text"}
        if extra and strict_fields:
            raise ValueError(f"part {index} has unsupported field(s): {', '.join(sorted(extra))}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {index} needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None
    refusal: Any = None
    tool_calls: list[ToolCall] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> str | None:
        return None if value is None else join_text_parts(value)

    @model_validator(mode="after")
    def _check_fields(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry 'tool_calls'")
        for name in _ECHOED_EMPTY_FIELDS:
            if getattr(self, name) not in (None, [], ""):
                raise ValueError(f"'{name}' is not supported by this server")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        """What the chat template renders: role, content, and the optional name,
        tool call id and tool calls."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.to_template_dict() for call in self.tool_calls]
        return message


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool")
        if self.calls_tools and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with tools unless "
                             "tool_choice is 'none'")
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools are offered: some given, and tool_choice is not 'none'."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

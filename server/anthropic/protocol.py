"""Schema of POST /v1/messages (Anthropic's Messages API) and its count_tokens.

Strict in types and finite like the OpenAI schemas (protocol/base.py), but open:
Anthropic clients send fields this server has no use for (`metadata`, beta options,
`service_tier`, `container`), so unknown keys are ignored here, as chat ignores them.

Content is a string or a list of blocks: `text`; `tool_use` (an assistant's call:
id, name, input) and `tool_result` (the user's answer to one: tool_use_id, content as
a string or text blocks, is_error); `thinking` / `redacted_thinking` (a reasoning
model's earlier thoughts, dropped from the prompt as Anthropic's own API may drop
them). Images and documents are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..protocol.common import MAX_STOP_STRINGS


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(AnthropicModel):
    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
_KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if isinstance(value, list):
            for block in value:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in _KNOWN_BLOCKS:
                    raise ValueError(f"content blocks of type {kind!r} are not supported "
                                     f"(supported: {', '.join(_KNOWN_BLOCKS)})")
        return value


class ToolDefinition(AnthropicModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(AnthropicModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    speculative: bool | None = None
    """As on chat: False decodes this request without speculative drafts."""


class CountTokensRequest(AnthropicModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

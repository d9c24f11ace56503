"""Schema of POST /v1/chat/completions.

Messages carry a role (system, user, assistant or tool) and content that is either a
string or a list of `{"type": "text", "text": ...}` parts; the parts are joined into
one string before the chat template sees them. Other part types (images, audio) are
refused by name. Fields an SDK writes back when a client replays an assistant message
(`refusal`, `tool_calls`, ...) are accepted while empty, refused once they carry data.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .common import MAX_TOP_LOGPROBS, GenerationFields, OpenAIModel

# Keys of an assistant message the OpenAI SDK echoes back; null/empty is harmless.
_ECHOED_EMPTY_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations")


def join_text_parts(value: Any) -> str:
    """Content as one string: a string as is, text parts concatenated."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for index, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {index} must be an object")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {index} has unsupported type {kind!r}; only 'text' is supported")
        extra = set(part) - {"type", "text"}
        if extra:
            raise ValueError(f"part {index} has unsupported field(s): {', '.join(sorted(extra))}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {index} needs a string 'text'")
        texts.append(part["text"])
    return "".join(texts)


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None
    refusal: Any = None
    tool_calls: Any = None
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
        for name in _ECHOED_EMPTY_FIELDS:
            if getattr(self, name) not in (None, [], ""):
                raise ValueError(f"'{name}' is not supported by this server")
        return self

    def to_template_dict(self) -> dict[str, str]:
        """What the chat template renders: role, content and optional name."""
        message = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

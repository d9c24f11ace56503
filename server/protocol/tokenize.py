"""Schemas of POST /tokenize and POST /detokenize (vLLM's shapes)."""

from __future__ import annotations

from pydantic import Field, model_validator

from .chat import ChatMessage
from .common import OpenAIModel


class TokenizeRequest(OpenAIModel):
    """Either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]

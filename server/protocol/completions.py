"""Schema of POST /v1/completions.

`prompt` takes the four shapes OpenAI allows, normalised to a list of prompts, each
either text or token ids:

    "hi"                 -> ["hi"]
    ["hi", "yo"]         -> ["hi", "yo"]
    [1, 2, 3]            -> [[1, 2, 3]]
    [[1, 2], [3]]        -> [[1, 2], [3]]
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .common import MAX_CHOICES, MAX_TOP_LOGPROBS, GenerationFields

Prompt = str | list[int]


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalise_prompt(value: Any) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists, and not empty")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(_is_token(v) for v in value):
        return [list(value)]
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        return [list(v) for v in value]
    raise ValueError("must be a string, a list of strings, a list of token ids "
                     "or a list of non-empty token-id lists")


class CompletionRequest(GenerationFields):
    prompt: Any
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Number of most likely tokens to return per position (OpenAI's legacy shape)."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[Prompt]:
        if value is None:
            raise ValueError("a prompt is required")
        prompts = normalise_prompt(value)
        for prompt in prompts:
            if isinstance(prompt, list) and any(t < 0 for t in prompt):
                raise ValueError("token ids must be non-negative")
        return prompts

    @model_validator(mode="after")
    def _check_combinations(self) -> "CompletionRequest":
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are "
                             "not computed)")
        if len(self.prompts) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(f"number of prompts times n must be at most {MAX_CHOICES}")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt

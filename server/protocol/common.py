"""Fields shared by chat and text completions: sampling, stopping, streaming.

Every model here is strict (a JSON string is not a number, 2.0 is not an integer),
forbids unknown keys (an unsupported OpenAI parameter is a 400 naming it, never a
silent ignore) and refuses NaN/Infinity. Every optional field defaults to None, so an
explicit JSON `null` means exactly the same as leaving the field out; the real
defaults are filled in later, in `server/sampling.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import OpenAIModel
from .response_format import ResponseFormat

MAX_CHOICES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
"""Matching costs up to O(length**2) per token in the worst case: keep it bounded."""
MAX_TOP_LOGPROBS = 20


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None


class GenerationFields(OpenAIModel):
    """The parameters both /v1/chat/completions and /v1/completions accept."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    """-1 or 0 turn top-k off (vLLM's convention)."""
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Any = None
    """A string or a list of strings; normalised to a list by the validator."""
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    speculative: bool | None = None
    """False: this request decodes without speculative drafts (latency tests)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("must be a string or a list of strings")
        if len(values) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(v == "" for v in values):
            raise ValueError("stop sequences must not be empty strings")
        if any(len(v) > MAX_STOP_STRING_CHARS for v in values):
            raise ValueError(f"stop sequences are limited to {MAX_STOP_STRING_CHARS} characters")
        return values

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(v < 0 for v in value):
            raise ValueError("token ids must be non-negative")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for key, bias in value.items():
            digits = key.strip()
            # ASCII only: str.isdigit() also takes "²" (int() refuses it) and "١" (== 1)
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"keys must be token ids (ASCII digits), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100]")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> "GenerationFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

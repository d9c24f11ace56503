"""Schema of POST /v1/embeddings (OpenAI's shape).

`input` is a string, a list of strings, a list of token ids, or a list of lists of
token ids; each string or id list is one input. `encoding_format` "float" (lists of
numbers) or "base64" (little-endian float32 bytes, what the OpenAI SDK asks for by
default); `dimensions` keeps the first N values and renormalises them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import OpenAIModel

MAX_EMBEDDING_INPUTS = 2048
"""Inputs per request, as OpenAI allows."""


class EmbeddingRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

"""Schemas of POST /v1/rerank (the Jina / Cohere shape llama.cpp's server and vLLM
serve) and POST /v1/score (vLLM's shape).

Rerank: `query` and `documents` (strings, or `{"text": ...}` objects); `top_n` keeps
the best N (None or 0: all); `return_documents` echoes each document's text.
Score: `text_1` and `text_2`, each a string or a list; one string against a list
scores it against every item, two lists of one length are scored pairwise.
"""

from __future__ import annotations

from pydantic import Field

from .base import OpenAIModel

MAX_RERANK_DOCUMENTS = 1024
"""Documents per /v1/rerank request (pairs per /v1/score request)."""


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    user: str | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(OpenAIModel):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None

"""POST /v1/rerank (Jina / Cohere shape) and POST /v1/score (vLLM's shape): a
cross-encoder's relevance of query-document pairs.

    body -> (query, document) pairs -> the tokenizer's pair encoding of each
         -> one engine pooling request per pair with `classify` (prefill only,
            batched with everything else; the checkpoint's `score` head applied to
            the last token's final hidden state: engine/models/classifier_head.py)
         -> label logits -> relevance score

The pair is encoded as `tokenizer(query, document)`, as transformers' and
sentence-transformers' cross-encoders encode it (BERT-style tokenizers put their
separators between the two; decoder tokenizers join them as their pair template
says). `relevance_score` is a log-odds, not a probability: the raw logit for a
one-label head (as llama.cpp's server returns), and for a head of several labels
the log-odds of label 1 against the rest, log(p1 / (1 - p1)) under a softmax (for
two labels: logit_1 - logit_0). sigmoid(score) is the probability in both cases.

Only a sequence-classification checkpoint scores pairs; any other model is a 400
naming why. Limits, each a 400 naming it: 1 to MAX_RERANK_DOCUMENTS documents, and a
pair of at most the context length less one token.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import Request, Response

from engine import Pooling

from ..edge.body import parse_request
from ..edge.errors import bad_request
from ..generation import ArraysResponse, json_until_disconnect, new_id
from ..protocol.rerank import MAX_RERANK_DOCUMENTS, RerankRequest, ScoreRequest
from .serving_embeddings import pooled_outputs, submit_pooling
from ..state import ServingState

CLASSIFY = Pooling("last", normalize=False, classify=True)
"""The engine request of a pair: the head on the last token's state."""


async def create_rerank(request: Request, state: ServingState) -> Response:
    body = await parse_request(request, RerankRequest, state.settings.max_request_bytes)
    model = state.check_model(body.model)
    documents = body.document_texts()
    _check_scorer(state)
    _check_count(len(documents), "documents")
    pairs = [(body.query, document) for document in documents]
    scored = await _score_pairs(request, state, pairs, "documents", "rerank")

    async def answer() -> dict[str, Any]:
        scores, tokens = await scored
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        keep = order[:body.top_n] if body.top_n else order
        return {"id": new_id("rerank"), "model": model,
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": documents[i]}}
                                if body.return_documents else {})} for i in keep],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_until_disconnect(request, answer(), ArraysResponse)


async def create_score(request: Request, state: ServingState) -> Response:
    body = await parse_request(request, ScoreRequest, state.settings.max_request_bytes)
    model = state.check_model(body.model)
    _check_scorer(state)
    pairs = _score_pairs_of(body.text_1, body.text_2)
    scored = await _score_pairs(request, state, pairs, "text_2", "score")

    async def answer() -> dict[str, Any]:
        scores, tokens = await scored
        return {"id": new_id("score"), "object": "list", "model": model,
                "data": [{"index": i, "object": "score", "score": score}
                         for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_until_disconnect(request, answer(), ArraysResponse)


def _score_pairs_of(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, else item by item."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    _check_count(len(firsts), "text_1")
    _check_count(len(seconds), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(f"'text_1' holds {len(firsts)} texts and 'text_2' {len(seconds)}; "
                          "give one text_1, or as many as text_2.", param="text_1",
                          code="invalid_value")
    return list(zip(firsts, seconds))


def _check_scorer(state: ServingState) -> None:
    if state.num_labels is None:
        raise bad_request(
            f"The model '{state.model_name}' has no sequence-classification head (its "
            "checkpoint is not a *ForSequenceClassification one), so it cannot score "
            "query-document pairs; serve a reranker (cross-encoder) checkpoint.",
            param="model", code="model_not_reranker")


def _check_count(count: int, param: str) -> None:
    if count == 0:
        raise bad_request(f"'{param}' must not be empty.", param=param, code="invalid_value")
    if count > MAX_RERANK_DOCUMENTS:
        raise bad_request(f"'{param}' holds {count} texts; at most {MAX_RERANK_DOCUMENTS} are "
                          "allowed per request.", param=param, code="too_many_documents")


async def _score_pairs(request: Request, state: ServingState, pairs: list[tuple[str, str]],
                       param: str, prefix: str):
    """Encode and submit every pair now (refusals are 4xx before any answer); returns
    the awaitable of (relevance scores in pair order, prompt tokens)."""
    inputs = await asyncio.to_thread(_pair_inputs, state, pairs, param)
    streams = submit_pooling(state, new_id(prefix), inputs, CLASSIFY)

    async def scores() -> tuple[list[float], int]:
        logits = await pooled_outputs(streams)
        return [relevance(row) for row in logits], sum(len(ids) for ids in inputs)

    return scores()


def _pair_inputs(state: ServingState, pairs: list[tuple[str, str]], param: str
                 ) -> list[list[int]]:
    inputs = []
    for index, (query, document) in enumerate(pairs):
        ids = list(state.tokenizer(query, document)["input_ids"])
        if not ids or len(ids) >= state.max_model_len:
            raise bad_request(f"{param}[{index}] with its query has {len(ids)} tokens; a pair "
                              f"needs 1 to {state.max_model_len - 1}.", param=f"{param}[{index}]",
                              code="context_length_exceeded")
        inputs.append(ids)
    return inputs


def relevance(logits: list[float]) -> float:
    """A pair's label logits -> its relevance score (see the module docstring)."""
    if len(logits) == 1:
        return logits[0]
    others = logits[:1] + logits[2:]
    peak = max(others)
    return logits[1] - (peak + math.log(sum(math.exp(x - peak) for x in others)))

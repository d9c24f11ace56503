"""POST /v1/embeddings: the served model's pooled hidden states.

    body -> EmbeddingRequest -> one engine embedding request per input (prefill-only
         work, batched with everything else: engine/pooling.py) -> vectors in order

Pooling follows the checkpoint (embedding_pooling.py): sentence-transformers' config
beside the weights when there is one, else the last token's state, normalised, as
decoder embedding models pool. `dimensions` keeps the first N values and
renormalises them (meaningful for models trained for it, Matryoshka-style).
Limits, each a 400 naming it: MAX_EMBEDDING_INPUTS inputs, and an input of at most
the context length less one token.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from typing import Any

from fastapi import Request, Response

from engine import Pooling

from ..edge.body import parse_request
from ..edge.errors import bad_request
from ..generation import (ArraysResponse, GenerationFailed, RequestStream, is_failed,
                          json_until_disconnect, new_id)
from ..text_pipeline.prompts import check_token_ids, encode_text
from ..protocol.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from ..state import ServingState


async def create_embeddings(request: Request, state: ServingState) -> Response:
    body = await parse_request(request, EmbeddingRequest, state.settings.max_request_bytes)
    model = state.check_model(body.model)
    inputs = await asyncio.to_thread(_token_inputs, state, body)
    streams = submit_pooling(state, new_id("embd"), inputs, state.embedding_pooling)

    async def collect() -> dict[str, Any]:
        vectors = await pooled_outputs(streams)
        tokens = sum(len(ids) for ids in inputs)
        return {"object": "list", "model": model,
                "data": [{"object": "embedding", "index": i,
                          "embedding": _encoded(_cut(v, body.dimensions), body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await json_until_disconnect(request, collect(), ArraysResponse)


def _token_inputs(state: ServingState, body: EmbeddingRequest) -> list[list[int]]:
    value = body.input
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        value = [value]
    if not value:
        raise bad_request("'input' must not be empty.", param="input", code="invalid_value")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"'input' holds {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} "
                          f"are allowed per request.", param="input", code="too_many_inputs")
    inputs = []
    for index, item in enumerate(value):
        ids = encode_text(state.tokenizer, item, True) if isinstance(item, str) else list(item)
        if isinstance(item, list):
            check_token_ids(ids, state.vocab_size, param=f"input[{index}]")
        if not ids or len(ids) >= state.max_model_len:
            raise bad_request(f"input[{index}] has {len(ids)} tokens; an input needs 1 to "
                              f"{state.max_model_len - 1}.", param=f"input[{index}]",
                              code="context_length_exceeded")
        inputs.append(ids)
    return inputs


def submit_pooling(state: ServingState, request_id: str, inputs: list[list[int]],
                   pooling: Pooling) -> list[RequestStream]:
    """One engine pooling request per input (ids `<request_id>-<i>`); all or none:
    a refusal cancels the ones already queued."""
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(inputs):
            streams.append(state.engine.submit(f"{request_id}-{i}", ids, max_new_tokens=1,
                                               streaming=False, eos_token_id=[], sampling={},
                                               pooling=pooling))
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


async def pooled_outputs(streams: list[RequestStream]) -> list[list[float]]:
    """Each stream's vector (or label logits), in order; every stream is cancelled on
    the way out, so a failure or a disconnect leaves nothing running."""
    try:
        return [await _embedding(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.cancel()


async def _embedding(stream: RequestStream) -> list[float]:
    async for output in stream:
        if is_failed(output):
            raise GenerationFailed(output.error or "unknown engine error")
        if output.is_finished():
            return output.embedding
    raise GenerationFailed("the embedding request ended without a vector")


def _cut(vector: list[float], dimensions: int | None) -> list[float]:
    if dimensions is None:
        return vector
    if dimensions > len(vector):
        raise bad_request(f"'dimensions' is {dimensions}; this model's embeddings have "
                          f"{len(vector)}.", param="dimensions", code="invalid_value")
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def _encoded(vector: list[float], encoding: str | None) -> list[float] | str:
    if encoding != "base64":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

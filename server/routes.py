"""The API routes. Generation lives in serving_chat.py / serving_completions.py /
serving_responses.py / anthropic/serving.py (Anthropic's Messages); embeddings,
rerank and score in serving_embeddings.py / serving_rerank.py;
the small endpoints (models, tokenize, detokenize) are answered here. The
operational ones (health, ready, metrics) are in routes_ops.py.

Every route checks the API key when keys are configured (see auth.py).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from .anthropic.serving import count_tokens, create_message
from .edge.auth import presented_key, require_api_key
from .edge.body import parse_request
from .generation import ArraysResponse
from .text_pipeline.detokenizer import decode_all
from .text_pipeline.prompts import check_token_ids, encode_text, render_chat
from .protocol.tokenize import DetokenizeRequest, TokenizeRequest
from .openai_api.serving_chat import create_chat_completion
from .openai_api.serving_completions import create_completion
from .embeddings.serving_embeddings import create_embeddings
from .embeddings.serving_rerank import create_rerank, create_score
from .openai_api.serving_responses import create_response
from .state import ServingState


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving


def generating_state(request: Request) -> ServingState:
    """The state, for a route that generates text: 400 when the server only embeds."""
    state = serving_state(request)
    state.check_generates()
    return state


api = APIRouter(dependencies=[Depends(require_api_key)])


@api.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await create_chat_completion(request, generating_state(request))


@api.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await create_completion(request, generating_state(request))


@api.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await create_response(request, generating_state(request))


@api.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await create_embeddings(request, serving_state(request))


@api.post("/v1/rerank")
@api.post("/v2/rerank")
@api.post("/rerank")
async def rerank(request: Request) -> Response:
    return await create_rerank(request, serving_state(request))


@api.post("/v1/score")
async def score(request: Request) -> Response:
    return await create_score(request, serving_state(request))


@api.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    state = serving_state(request)
    return JSONResponse(state.responses.get(response_id, _key(request, state)).response)


@api.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    state = serving_state(request)
    state.responses.delete(response_id, _key(request, state))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _key(request: Request, state: ServingState) -> str | None:
    """The caller's API key where keys are set (a stored response's owner), else None."""
    return presented_key(request) if state.settings.api_key else None


@api.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await create_message(request, generating_state(request))


@api.post("/v1/messages/count_tokens")
async def messages_count_tokens(request: Request) -> Response:
    return await count_tokens(request, serving_state(request))


def _model_card(state: ServingState) -> dict:
    speculative = state.settings.continuous_batching_config().speculative_config
    if not state.engine.stats().get("spec_decode"):      # refused for this model
        speculative = None
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "kvserve", "root": state.settings.model,
            "max_model_len": state.max_model_len, **state.chat_format.capabilities,
            "speculative_decoding": None if speculative is None else speculative.as_dict()}


@api.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(serving_state(request))]})


@api.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    state = serving_state(request)
    state.check_model(model_id)
    return JSONResponse(_model_card(state))


@api.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = serving_state(request)
    body = await parse_request(request, TokenizeRequest, state.settings.max_request_bytes)
    state.check_model(body.model)
    # every tokenizer call runs off the event loop: a 4 MB body takes seconds
    if body.messages is not None:
        add_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
        rendered = await asyncio.to_thread(render_chat, state.tokenizer, state.chat_format,
                                           body.messages, add_prompt)
        tokens = rendered.ids
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await asyncio.to_thread(encode_text, state.tokenizer, body.prompt,
                                         add_special)
    return ArraysResponse({"count": len(tokens), "max_model_len": state.max_model_len,
                           "tokens": tokens})


@api.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = serving_state(request)
    body = await parse_request(request, DetokenizeRequest, state.settings.max_request_bytes)
    state.check_model(body.model)
    check_token_ids(body.tokens, state.vocab_size, param="tokens")
    text = await asyncio.to_thread(decode_all, state.tokenizer, body.tokens, False)
    return JSONResponse({"prompt": text})

"""The OpenAPI document (`GET /openapi.json`, the API docs pages): FastAPI's, plus
what our routes accept and how they fail.

Routes read their own bodies (body.py: one clear error per way a body can be wrong),
so FastAPI sees no body model and would document none. Here every POST route gets its
request body's JSON schema from the same pydantic model that validates it, so the
document says exactly what the route accepts (a client generator or a fuzzer reading
it sends what the server takes), and every operation's 4XX answers get their error
shape: OpenAI's `{"error": {...}}`, or Anthropic's on /v1/messages.

    pydantic model --model_json_schema(ref_template=components)--> requestBody
                   \\--its $defs--> components.schemas
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from .anthropic.protocol import CountTokensRequest, MessagesRequest
from .protocol.chat import ChatCompletionRequest
from .protocol.completions import CompletionRequest
from .protocol.embeddings import EmbeddingRequest
from .protocol.rerank import RerankRequest, ScoreRequest
from .protocol.responses import ResponsesRequest
from .protocol.tokenize import DetokenizeRequest, TokenizeRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest, "/rerank": RerankRequest,
    "/v1/score": ScoreRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""POST path -> the model its route validates its body with."""

REF_TEMPLATE = "#/components/schemas/{model}"
_TEXT = {"type": ["string", "null"]}
ERROR_SHAPES = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _TEXT, "code": _TEXT}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {
            "type": "object", "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for `app` with the request bodies and error shapes added
    (a new dict each call; FastAPI caches its own part)."""
    document = dict(app.openapi())
    schemas = dict(document.get("components", {}).get("schemas", {}))
    schemas.update(ERROR_SHAPES)
    paths = {}
    for path, operations in document["paths"].items():
        paths[path] = {method: _with_body_and_errors(path, method, operation, schemas)
                       for method, operation in operations.items()}
    return {**document, "paths": paths,
            "components": {**document.get("components", {}), "schemas": schemas}}


def _with_body_and_errors(path: str, method: str, operation: dict, schemas: dict) -> dict:
    operation = dict(operation)
    model = BODIES.get(path) if method == "post" else None
    if model is not None:
        schema = model.model_json_schema(ref_template=REF_TEMPLATE)
        for name, part in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            if schemas.setdefault(name, part) != part:    # two dialects' models, one name
                raise RuntimeError(f"OpenAPI components: two different schemas named {name}")
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}}}}
    shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
    responses = {code: answer for code, answer in operation.get("responses", {}).items()
                 if code != "422"}       # FastAPI's own validation errors never reach clients
    responses["4XX"] = {"description": "The request cannot be served as sent.",
                        "content": {"application/json": {"schema": {
                            "$ref": REF_TEMPLATE.format(model=shape)}}}}
    operation["responses"] = responses
    return operation

"""From a request's `response_format` to a compiled grammar the engine enforces.

    text         -> no grammar
    json_object  -> GrammarSpec("json_object"): any JSON object, compact
    json_schema  -> GrammarSpec("json_schema", schema): the schema, compact; a schema-less
                    json_schema format means any JSON value

Tools (server/text_pipeline/tool_formats.py) and thinking models (server/text_pipeline/reasoning.py) make their
own specs and compile them through `compile_spec` as well.

Compiling runs off the event loop (a large schema can take a while, and the first
grammar builds the tokenizer's index); a grammar the library refuses is a
400 naming `response_format` and the library's message (the schema part, say).
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.grammar import CompiledGrammar, GrammarSpec

from ..edge.errors import bad_request
from ..protocol.response_format import ResponseFormat
from ..state import ServingState


def grammar_spec(response_format: ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object")
    schema: Any = response_format.json_schema.schema_
    return GrammarSpec("json_schema", {} if schema is None else schema)


async def compile_spec(state: ServingState, spec: GrammarSpec | None,
                       param: str) -> CompiledGrammar | None:
    """`spec` compiled for the engine; a 400 naming `param` (the request field the
    grammar came from) when the library refuses it."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(state.engine.compile_grammar, spec)
    except InvalidRequestError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from None


async def compile_response_format(state: ServingState, response_format: ResponseFormat | None
                                  ) -> CompiledGrammar | None:
    return await compile_spec(state, grammar_spec(response_format), "response_format")

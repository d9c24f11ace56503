"""POST /v1/chat/completions.

    body -> ChatCompletionRequest -> chat template -> prompt ids -> GenerationPlan
         -> n engine requests -> merged deltas -> one JSON response, or SSE chunks

A streamed answer is, per choice: a first chunk with `{"role": "assistant"}`, content
chunks, and a chunk carrying `finish_reason`; with `stream_options.include_usage`
every chunk has `"usage": null` and one last chunk has no choices and the usage.
"""

from __future__ import annotations

import asyncio

import contextlib
import time
from typing import Any, AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from .body import parse_request
from .generation import (Choice, ClientDisconnected, GenerationRun, cancel_all, merge_deltas,
                         new_id, run_until_disconnect, start_run, submit_choices, usage)
from .logprobs import chat_logprobs
from .prompts import render_chat
from .protocol.chat import ChatCompletionRequest
from .sampling import GenerationPlan, build_plan
from .sse import DONE, TextEvents, event, sse_response
from .state import ServingState
from .structured_output import compile_response_format


async def create_chat_completion(request: Request, state: ServingState) -> Response:
    run = start_run(request, state)
    header = {"id": new_id("chatcmpl"), "created": int(time.time())}
    run.record.request_id = header["id"]
    body = await parse_request(request, ChatCompletionRequest, state.settings.max_request_bytes)
    header["model"] = state.check_model(body.model)
    # rendering and tokenizing a large body takes a while: off the event loop
    prompt_ids = await asyncio.to_thread(render_chat, state.tokenizer, body.messages)
    grammar = await compile_response_format(state, body.response_format)
    plan = build_plan(body, state, max_tokens=body.requested_max_tokens,
                      logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
                      grammar=grammar)
    run.record.stream, run.record.prompt_tokens = plan.stream, len(prompt_ids)
    if state.settings.log_prompts:
        run.record.prompt_text = state.tokenizer.decode(prompt_ids)
    choices = submit_choices(state, header["id"], [prompt_ids], plan)
    if plan.stream:
        return sse_response(_stream(state, run, choices, plan, header, len(prompt_ids)),
                            on_close=lambda: cancel_all(choices))
    try:
        result = await run_until_disconnect(
            request, _collect(state, run, choices, plan, header, len(prompt_ids)))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result)


async def _collect(state: ServingState, run: GenerationRun, choices: list[Choice],
                   plan: GenerationPlan, header: dict[str, Any],
                   prompt_tokens: int) -> dict[str, Any]:
    texts: dict[int, list[str]] = {c.index: [] for c in choices}
    content: dict[int, list[dict]] = {c.index: [] for c in choices}
    async with contextlib.aclosing(merge_deltas(choices, run)) as deltas:
        async for index, delta in deltas:
            texts[index].append(delta.text)
            if plan.logprobs:
                content[index].extend(chat_logprobs(delta, state.token_texts)["content"])
    return {
        **header, "object": "chat.completion", "system_fingerprint": None,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(texts[c.index]),
                        "refusal": None, "tool_calls": []},
            "logprobs": {"content": content[c.index], "refusal": None} if plan.logprobs else None,
            "finish_reason": c.decoder.finish_reason,
        } for c in choices],
        "usage": usage(prompt_tokens, sum(c.decoder.num_generated for c in choices)),
    }


async def _stream(state: ServingState, run: GenerationRun, choices: list[Choice],
                  plan: GenerationPlan, header: dict[str, Any],
                  prompt_tokens: int) -> AsyncIterator[dict[str, str]]:
    def payload(choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**header, "object": "chat.completion.chunk", "system_fingerprint": None,
                 "choices": choice_list}
        if plan.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk(choice_list: list[dict[str, Any]]) -> dict[str, str]:
        return event(payload(choice_list))

    text_chunk = TextEvents(lambda index, text: payload([{
        "index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]))

    for c in choices:
        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    async with contextlib.aclosing(merge_deltas(choices, run)) as deltas:
        async for index, delta in deltas:
            if delta.finish_reason is None and not plan.logprobs:
                if delta.text:        # the common chunk: text alone
                    yield text_chunk(index, delta.text)
                continue  # else tokens held back (partial character or stop prefix)
            yield chunk([{
                "index": index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": chat_logprobs(delta, state.token_texts) if plan.logprobs else None,
                "finish_reason": delta.finish_reason,
            }])
    if plan.include_usage:
        completion_tokens = sum(c.decoder.num_generated for c in choices)
        yield event({**header, "object": "chat.completion.chunk", "system_fingerprint": None,
                     "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield DONE

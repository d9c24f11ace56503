"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

    body -> MessagesRequest -> ChatCompletionRequest (translate.py) -> the chat path
         (serving_chat.submit_chat) -> one message, or Anthropic's named events

Any `model` name is accepted (Anthropic clients send their own) and echoed back. A
whole answer is a message whose `content` holds a `thinking` block (reasoning
models), a `text` block and a `tool_use` block per call, with `stop_reason` end_turn,
max_tokens, stop_sequence (and which) or tool_use. A streamed one is, in order:

    message_start, ping,
    per block: content_block_start, content_block_delta (text_delta, thinking_delta
      or input_json_delta) ..., content_block_stop,
    message_delta (stop_reason, output tokens), message_stop

An error after the stream began is an `error` event in Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any, AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from ..edge.body import parse_json_object, read_body, validate_model
from ..edge.errors import OpenAIError
from ..generation import GenerationRun, cancel_all, json_until_disconnect, merge_deltas, start_run
from ..text_pipeline.prompts import render_chat
from ..openai_api.serving_chat import SubmittedChat, submit_chat
from ..edge.sse import event, sse_response
from ..state import ServingState
from .errors import anthropic_error_body
from .protocol import CountTokensRequest, MessagesRequest
from .stream_blocks import BlockEvents
from .translate import to_chat_request

logger = logging.getLogger(__name__)


async def create_message(request: Request, state: ServingState) -> Response:
    run = start_run(request, state)
    message_id = f"msg_{uuid.uuid4().hex}"
    run.record.request_id = message_id
    raw = await read_body(request, state.settings.max_request_bytes)
    body = validate_model(MessagesRequest, parse_json_object(raw))
    chat = await submit_chat(state, run, to_chat_request(body), message_id)
    job = _MessageJob(run, chat, {"id": message_id, "type": "message", "role": "assistant",
                                  "model": body.model})
    if chat.plan.stream:
        return sse_response(job.stream(), on_close=lambda: cancel_all(chat.choices),
                            write_timeout_s=state.settings.stream_write_timeout_s)
    return await json_until_disconnect(request, job.collect())


async def count_tokens(request: Request, state: ServingState) -> JSONResponse:
    """{"input_tokens": N}: the prompt the same messages, system and tools render to."""
    raw = await read_body(request, state.settings.max_request_bytes)
    chat = to_chat_request(validate_model(CountTokensRequest, parse_json_object(raw)))
    rendered = await asyncio.to_thread(render_chat, state.tokenizer, state.chat_format,
                                       chat.messages, True,
                                       chat.tools if chat.calls_tools else None,
                                       chat.chat_template_kwargs)
    return JSONResponse({"input_tokens": len(rendered.ids)})


def stop_fields(chat: SubmittedChat, calls_tools: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence of the (only) choice."""
    decoder = chat.choices[0].decoder
    if decoder.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if decoder.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": decoder.stop_sequence}
    return {"stop_reason": "tool_use" if calls_tools else "end_turn", "stop_sequence": None}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message (AnswerShape.message) as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


class _MessageJob:
    def __init__(self, run: GenerationRun, chat: SubmittedChat, header: dict[str, Any]) -> None:
        self.run, self.chat, self.header = run, chat, header

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.chat.prompt_tokens, "output_tokens": output_tokens}

    async def collect(self) -> dict[str, Any]:
        texts: list[str] = []
        async with contextlib.aclosing(merge_deltas(self.chat.choices, self.run)) as deltas:
            async for _, delta in deltas:
                texts.append(delta.text)
        message, calls_tools = self.chat.shape.message("".join(texts))
        return {**self.header, "content": content_blocks(message),
                **stop_fields(self.chat, calls_tools),
                "usage": self._usage(self.chat.choices[0].decoder.num_generated)}

    async def stream(self) -> AsyncIterator[dict[str, str]]:
        yield event({"type": "message_start", "message": {
            **self.header, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": self._usage(0)}}, "message_start")
        yield event({"type": "ping"}, "ping")
        answer, blocks = self.chat.shape.stream(), BlockEvents()
        try:
            async with contextlib.aclosing(merge_deltas(self.chat.choices, self.run)) as deltas:
                async for _, delta in deltas:
                    for part in answer.step(delta):
                        for item in blocks.feed(part):
                            yield item
        except OpenAIError as exc:
            yield event(anthropic_error_body(exc.status_code, exc.message), "error")
            return
        except Exception:
            logger.exception("message stream failed")
            yield event(anthropic_error_body(500, "The server had an internal error while "
                                                  "streaming."), "error")
            return
        for item in blocks.close():
            yield item
        yield event({"type": "message_delta", "delta": stop_fields(self.chat, answer.num_calls > 0),
                     "usage": {"output_tokens": self.chat.choices[0].decoder.num_generated}},
                    "message_delta")
        yield event({"type": "message_stop"}, "message_stop")

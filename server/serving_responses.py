"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

    body -> ResponsesRequest -> ChatCompletionRequest (responses_input.py)
         -> chat template -> AnswerShape (tools, thinking, grammar) -> GenerationPlan
         -> one engine request -> the chat path's answer (a message, or its deltas)
         -> Response object (responses_output.py), or its events (responses_stream.py)

Stateless: nothing is stored (`store: true` is accepted and logged once), so a
conversation goes whole in `input` each turn, function calls and their outputs
included. Errors about a field the chat request names its own way are renamed to
the Responses field (`messages` -> `input`, `max_tokens` -> `max_output_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request, Response

from .body import parse_request
from .chat_answer import AnswerShape
from .errors import OpenAIError
from .generation import (Choice, GenerationRun, cancel_all, merge_deltas,
                         json_until_disconnect, start_run, submit_choices)
from .prompts import render_chat
from .protocol.responses import ResponsesRequest
from .responses_input import function_tools, to_chat_request
from .responses_output import finished, in_progress, item_id, output_items, usage
from .responses_stream import ResponseEvents, internal_error
from .sampling import build_plan
from .sse import EventStreamResponse
from .state import ServingState
from .structured_output import compile_spec

logger = logging.getLogger(__name__)

_RENAMED_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                   "response_format": "text.format"}
_store_logged = False


def _log_store_once() -> None:
    global _store_logged
    if not _store_logged:
        _store_logged = True
        logger.info("a /v1/responses request asked for store=true; this server stores no "
                    "responses (logged once)")


@contextlib.contextmanager
def _responses_params():
    """Rename the chat request's field names in errors raised inside."""
    try:
        yield
    except OpenAIError as error:
        if error.param in _RENAMED_PARAMS:
            error.param = _RENAMED_PARAMS[error.param]
        raise


async def create_response(request: Request, state: ServingState) -> Response:
    run = start_run(request, state)
    response_id = item_id("resp")
    run.record.request_id = response_id
    body = await parse_request(request, ResponsesRequest, state.settings.max_request_bytes,
                               ignore_unknown=True)
    if body.store:
        _log_store_once()
    tools = function_tools(body)
    chat = to_chat_request(body, tools)
    model = state.check_model(body.model)
    with _responses_params():
        rendered = await asyncio.to_thread(render_chat, state.tokenizer, state.chat_format,
                                           chat.messages, True,
                                           chat.tools if chat.calls_tools else None)
        shape = AnswerShape.of(chat, state, rendered.text)
        grammar = await compile_spec(state, shape.grammar_spec(chat),
                                     "tools" if shape.tools is not None else "text.format")
        plan = build_plan(chat, state, max_tokens=chat.requested_max_tokens, logprobs=False,
                          top_logprobs=0, grammar=grammar)
        run.record.stream, run.record.prompt_tokens = plan.stream, len(rendered.ids)
        if state.settings.log_prompts:
            run.record.prompt_text = rendered.text
        choices = submit_choices(state, response_id, [rendered.ids], plan)
    job = _ResponseJob(state, run, choices, shape, in_progress(body, tools, response_id, model))
    if plan.stream:
        return EventStreamResponse(job.stream(), on_close=lambda: cancel_all(choices),
                                   write_timeout_s=state.settings.stream_write_timeout_s)
    return await json_until_disconnect(request, job.collect())


@dataclass
class _ResponseJob:
    state: ServingState
    run: GenerationRun
    choices: list[Choice]
    shape: AnswerShape
    response: dict[str, Any]
    """The response as it stands before any output (responses_output.in_progress)."""

    @property
    def _choice(self) -> Choice:
        return self.choices[0]

    def _usage(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning"
                            for part in item["content"])
        reasoning_tokens = len(self.state.tokenizer.encode(reasoning, add_special_tokens=False)
                               ) if reasoning else 0
        return usage(len(self._choice.prompt_ids), self._choice.decoder.num_generated,
                     reasoning_tokens)

    @property
    def _incomplete(self) -> bool:
        return self._choice.decoder.finish_reason == "length"

    async def collect(self) -> dict[str, Any]:
        texts: list[str] = []
        async with contextlib.aclosing(merge_deltas(self.choices, self.run)) as deltas:
            async for _, delta in deltas:
                texts.append(delta.text)
        message, _ = self.shape.message("".join(texts))
        output = output_items(message, self._incomplete)
        return finished(self.response, output, self._incomplete, self._usage(output))

    async def stream(self) -> AsyncIterator[dict[str, str]]:
        """The events (responses_stream.py); a failure after the start becomes an
        `error` event and `response.failed`."""
        events = ResponseEvents(self.response)
        for item in events.start():
            yield item
        answer = self.shape.stream()
        try:
            async with contextlib.aclosing(merge_deltas(self.choices, self.run)) as deltas:
                async for _, delta in deltas:
                    parts = answer.feed(delta.text) if delta.text else []
                    if delta.finish_reason is not None:
                        parts += answer.finish()
                    for part in parts:
                        for item in events.delta(part):
                            yield item
        except OpenAIError as error:
            failure = error
        except Exception:
            failure = internal_error()
        else:
            for item in events.finish(self._incomplete, self._usage(events.output)):
                yield item
            return
        for item in events.fail(failure):
            yield item

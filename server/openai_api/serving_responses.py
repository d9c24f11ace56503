"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

    body -> ResponsesRequest -> ChatCompletionRequest (responses_input.py)
         -> chat template -> AnswerShape (tools, thinking, grammar) -> GenerationPlan
         -> one engine request -> the chat path's answer (a message, or its deltas)
         -> Response object (responses_output.py), or its events (responses_stream.py)

A finished response is stored unless the request says `store: false`
(responses_store.py): `previous_response_id` then continues its conversation, and
GET / DELETE /v1/responses/{id} read and drop it (only with the API key that made
it). A conversation can also go whole in `input` each turn, function calls and their
outputs included. Errors about a field the chat request names its own way are
renamed to the Responses field (`messages` -> `input`, `max_tokens` ->
`max_output_tokens`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request, Response

from ..edge.auth import presented_key
from ..edge.body import parse_request
from .chat_answer import AnswerShape
from ..edge.errors import OpenAIError
from ..generation import (Choice, GenerationRun, cancel_all, merge_deltas,
                         json_until_disconnect, start_run)
from ..protocol.responses import ResponsesRequest
from .responses_input import answer_messages, function_tools, to_chat_request
from .responses_output import finished, in_progress, item_id, output_items, usage
from .responses_stream import ResponseEvents, internal_error
from .serving_chat import submit_chat
from ..edge.sse import EventStreamResponse
from ..state import ServingState

_RENAMED_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                   "response_format": "text.format"}


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
    key = presented_key(request) if state.settings.api_key else None
    history = [] if body.previous_response_id is None else state.responses.get(
        body.previous_response_id, key, "previous_response_id").history
    tools = function_tools(body)
    chat = to_chat_request(body, tools, history)
    model = state.check_model(body.model)
    with _responses_params():
        submitted = await submit_chat(state, run, chat, response_id, format_param="text.format")
    conversation = [m.model_dump(exclude_none=True) for m in chat.messages]
    keep = None if body.store is False else \
        _Keeper(state, key, conversation[1:] if body.instructions else conversation)
    plan, choices = submitted.plan, submitted.choices
    job = _ResponseJob(state, run, choices, submitted.shape,
                       in_progress(body, tools, response_id, model), keep)
    if plan.stream:
        return EventStreamResponse(job.stream(), on_close=lambda: cancel_all(choices),
                                   write_timeout_s=state.settings.stream_write_timeout_s)
    return await json_until_disconnect(request, job.collect())


@dataclass(frozen=True)
class _Keeper:
    """Stores a finished response with its conversation (store is not false)."""
    state: ServingState
    key: str | None
    conversation: list[dict[str, Any]]
    """The request's chat messages, the instructions' system message left out."""

    def keep(self, response: dict[str, Any]) -> dict[str, Any]:
        self.state.responses.put(response["id"], response,
                                 self.conversation + answer_messages(response["output"]),
                                 self.key)
        return response


@dataclass
class _ResponseJob:
    state: ServingState
    run: GenerationRun
    choices: list[Choice]
    shape: AnswerShape
    response: dict[str, Any]
    """The response as it stands before any output (responses_output.in_progress)."""
    keeper: _Keeper | None

    def _done(self, response: dict[str, Any]) -> dict[str, Any]:
        return response if self.keeper is None else self.keeper.keep(response)

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
        return self._done(finished(self.response, output, self._incomplete, self._usage(output)))

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
                    for part in answer.step(delta):
                        for item in events.delta(part):
                            yield item
        except OpenAIError as error:
            failure = error
        except Exception:
            failure = internal_error()
        else:
            usage_ = self._usage(events.output)
            for item in events.finish(self._incomplete, usage_):
                yield item
            self._done(finished(self.response, events.output, self._incomplete, usage_))
            return
        for item in events.fail(failure):
            yield item

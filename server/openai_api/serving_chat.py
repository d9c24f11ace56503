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
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request, Response

from ..edge.body import parse_request
from .chat_answer import AnswerShape
from ..generation import (Choice, GenerationRun, cancel_all, merge_deltas,
                         json_until_disconnect, new_id, start_run, submit_choices, usage)
from ..text_pipeline.logprobs import chat_logprobs
from ..text_pipeline.prompts import render_chat
from ..protocol.chat import ChatCompletionRequest, ChatMessage
from ..sampling import GenerationPlan, build_plan
from ..edge.sse import DONE, TextEvents, event, sse_response
from ..state import ServingState
from ..text_pipeline.structured_output import compile_spec


async def create_chat_completion(request: Request, state: ServingState) -> Response:
    run = start_run(request, state)
    header = {"id": new_id("chatcmpl"), "created": int(time.time())}
    run.record.request_id = header["id"]
    body = await parse_request(request, ChatCompletionRequest, state.settings.max_request_bytes,
                               ignore_unknown=True, message_cls=ChatMessage)
    header["model"] = state.check_model(body.model)
    chat = await submit_chat(state, run, body, header["id"])
    plan, choices = chat.plan, chat.choices
    job = _ChatJob(state, run, choices, plan, header, chat.prompt_tokens, chat.shape)
    if plan.stream:
        return sse_response(job.stream(), on_close=lambda: cancel_all(choices),
                            write_timeout_s=state.settings.stream_write_timeout_s)
    return await json_until_disconnect(request, job.collect())


@dataclass(frozen=True)
class SubmittedChat:
    prompt_tokens: int
    shape: AnswerShape
    plan: GenerationPlan
    choices: list[Choice]


async def submit_chat(state: ServingState, run: GenerationRun, body: ChatCompletionRequest,
                      response_id: str, format_param: str = "response_format") -> SubmittedChat:
    """A validated chat body's prompt, answer shape, grammar and plan, and its choices
    queued in the engine (the chat route's, and the Messages and Responses APIs' after
    translation). `format_param`: the name a refused response_format is given."""
    # rendering and tokenizing a large body takes a while: off the event loop
    rendered = await asyncio.to_thread(render_chat, state.tokenizer, state.chat_format,
                                       body.messages, True,
                                       body.tools if body.calls_tools else None,
                                       body.chat_template_kwargs)
    prompt_ids = rendered.ids
    shape = AnswerShape.of(body, state, rendered.text)
    grammar = await compile_spec(state, shape.grammar_spec(body),
                                 "tools" if shape.tools is not None else format_param)
    plan = build_plan(body, state, max_tokens=body.requested_max_tokens,
                      logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
                      grammar=grammar)
    run.record.stream, run.record.prompt_tokens = plan.stream, len(prompt_ids)
    if state.settings.log_prompts:
        run.record.prompt_text = state.tokenizer.decode(prompt_ids)
    choices = submit_choices(state, response_id, [prompt_ids], plan)
    return SubmittedChat(len(prompt_ids), shape, plan, choices)


def _finish_reason(reason: str | None, calls_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by calling tools."""
    return "tool_calls" if calls_tools and reason == "stop" else reason


@dataclass
class _ChatJob:
    state: ServingState
    run: GenerationRun
    choices: list[Choice]
    plan: GenerationPlan
    header: dict[str, Any]
    prompt_tokens: int
    shape: AnswerShape

    async def collect(self) -> dict[str, Any]:
        state, plan, choices = self.state, self.plan, self.choices
        texts: dict[int, list[str]] = {c.index: [] for c in choices}
        content: dict[int, list[dict]] = {c.index: [] for c in choices}
        async with contextlib.aclosing(merge_deltas(choices, self.run)) as deltas:
            async for index, delta in deltas:
                texts[index].append(delta.text)
                if plan.logprobs:
                    content[index].extend(chat_logprobs(delta, state.token_texts)["content"])
        answers = {c.index: self.shape.message("".join(texts[c.index])) for c in choices}
        return {
            **self.header, "object": "chat.completion", "system_fingerprint": None,
            "choices": [{
                "index": c.index,
                "message": answers[c.index][0],
                "logprobs": {"content": content[c.index], "refusal": None} if plan.logprobs else None,
                "finish_reason": _finish_reason(c.decoder.finish_reason, answers[c.index][1]),
            } for c in choices],
            "usage": usage(self.prompt_tokens, sum(c.decoder.num_generated for c in choices)),
        }

    def _payload(self, choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self.header, "object": "chat.completion.chunk", "system_fingerprint": None,
                 "choices": choice_list}
        if self.plan.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> dict[str, str]:
        return event(self._payload([{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]))

    async def stream(self) -> AsyncIterator[dict[str, str]]:
        plan, choices = self.plan, self.choices
        text_chunk = TextEvents(lambda index, text: self._payload([{
            "index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]))
        answers = {c.index: self.shape.stream() for c in choices}
        plain = self.shape.tools is None and self.shape.thinking is None
        for c in choices:
            yield self._chunk(c.index, {"role": "assistant", "content": ""})
        async with contextlib.aclosing(merge_deltas(choices, self.run)) as deltas:
            async for index, delta in deltas:
                answer = answers[index]
                if plain and delta.finish_reason is None and not plan.logprobs:
                    if delta.text:        # the common chunk: text alone
                        yield text_chunk(index, delta.text)
                    continue  # else tokens held back (partial character or stop prefix)
                parts = answer.step(delta)
                logprobs = chat_logprobs(delta, self.state.token_texts) if plan.logprobs else None
                for part in parts[:-1] if delta.finish_reason is not None or logprobs else parts:
                    yield self._chunk(index, part)
                if delta.finish_reason is not None or logprobs:
                    last = parts[-1] if parts else {}
                    yield self._chunk(index, last, logprobs, _finish_reason(
                        delta.finish_reason, answer.num_calls > 0))
        if plan.include_usage:
            completion_tokens = sum(c.decoder.num_generated for c in choices)
            yield event({**self.header, "object": "chat.completion.chunk",
                         "system_fingerprint": None, "choices": [],
                         "usage": usage(self.prompt_tokens, completion_tokens)})
        yield DONE

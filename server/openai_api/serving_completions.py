"""POST /v1/completions (the legacy text completion API).

Each of the P prompts gets n choices, numbered prompt-major: choice `p * n + i` is the
i-th sample of prompt p. `echo` puts the prompt text in front of the completion
(in the first streamed chunk of each choice). `logprobs: k` returns the sampled
tokens' logprobs and the k most likely alternatives per position.
"""

from __future__ import annotations

import asyncio

import contextlib
import time
from typing import Any, AsyncIterator

from fastapi import Request, Response

from ..edge.body import parse_request
from ..text_pipeline.detokenizer import decode_all
from ..generation import (Choice, GenerationRun, cancel_all, merge_deltas,
                         json_until_disconnect, new_id, start_run, submit_choices, usage)
from ..text_pipeline.logprobs import CompletionLogprobs, merge_completion_logprobs
from ..text_pipeline.prompts import completion_prompt_ids
from ..protocol.completions import CompletionRequest
from ..sampling import GenerationPlan, build_plan
from ..edge.sse import DONE, TextEvents, event, sse_response
from ..state import ServingState
from ..text_pipeline.structured_output import compile_response_format

# OpenAI's default completion length for this endpoint.
DEFAULT_MAX_TOKENS = 16


async def create_completion(request: Request, state: ServingState) -> Response:
    run = start_run(request, state)
    header = {"id": new_id("cmpl"), "created": int(time.time())}
    run.record.request_id = header["id"]
    body = await parse_request(request, CompletionRequest, state.settings.max_request_bytes,
                               ignore_unknown=True)
    header["model"] = state.check_model(body.model)
    # tokenizing a large body takes a while: off the event loop
    prompts = await asyncio.to_thread(completion_prompt_ids, state.tokenizer, body.prompts,
                                      state.vocab_size)
    want_logprobs = body.logprobs is not None
    grammar = await compile_response_format(state, body.response_format)
    plan = build_plan(body, state, max_tokens=body.max_tokens or DEFAULT_MAX_TOKENS,
                      logprobs=want_logprobs, top_logprobs=body.logprobs or 0,
                      grammar=grammar)
    echoes = [_echo_text(state, raw, ids) if body.echo else ""
              for raw, ids in zip(body.prompts, prompts)]
    prompt_tokens = sum(len(p) for p in prompts)
    run.record.stream, run.record.prompt_tokens = plan.stream, prompt_tokens
    if state.settings.log_prompts:
        run.record.prompt_text = " | ".join(decode_all(state.tokenizer, p) for p in prompts)
    choices = submit_choices(state, header["id"], prompts, plan)
    job = _CompletionJob(state, run, choices, plan, header, echoes, prompt_tokens)
    if plan.stream:
        return sse_response(job.stream(), on_close=lambda: cancel_all(choices),
                            write_timeout_s=state.settings.stream_write_timeout_s)
    return await json_until_disconnect(request, job.collect())


def _echo_text(state: ServingState, raw_prompt: str | list[int], prompt_ids: list[int]) -> str:
    if isinstance(raw_prompt, str):
        return raw_prompt
    return decode_all(state.tokenizer, prompt_ids)


class _CompletionJob:
    """The choices of one completion request and how to report them."""

    def __init__(self, state: ServingState, run: GenerationRun, choices: list[Choice],
                 plan: GenerationPlan, header: dict[str, Any], echoes: list[str],
                 prompt_tokens: int) -> None:
        self.state = state
        self.run = run
        self.choices = choices
        self.plan = plan
        self.header = header
        self.prompt_tokens = prompt_tokens
        self.echo = {c.index: echoes[c.prompt_index] for c in choices}
        self.logprobs = {c.index: CompletionLogprobs(state.token_texts, len(self.echo[c.index]))
                         for c in choices}

    def _completion_tokens(self) -> int:
        return sum(c.decoder.num_generated for c in self.choices)

    async def collect(self) -> dict[str, Any]:
        texts = {c.index: [self.echo[c.index]] for c in self.choices}
        logprob_parts: dict[int, list[dict]] = {c.index: [] for c in self.choices}
        async with contextlib.aclosing(merge_deltas(self.choices, self.run)) as deltas:
            async for index, delta in deltas:
                texts[index].append(delta.text)
                if self.plan.logprobs:
                    logprob_parts[index].append(self.logprobs[index].format(delta))
        return {
            **self.header, "object": "text_completion", "system_fingerprint": None,
            "choices": [{
                "index": c.index, "text": "".join(texts[c.index]),
                "logprobs": (merge_completion_logprobs(logprob_parts[c.index])
                             if self.plan.logprobs else None),
                "finish_reason": c.decoder.finish_reason,
            } for c in self.choices],
            "usage": usage(self.prompt_tokens, self._completion_tokens()),
        }

    def _payload(self, index: int, text: str, logprobs: Any = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        payload = {**self.header, "object": "text_completion", "system_fingerprint": None,
                   "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish_reason}]}
        if self.plan.include_usage:
            payload["usage"] = None
        return payload

    def _chunk(self, index: int, text: str, logprobs: Any, finish_reason: str | None):
        return event(self._payload(index, text, logprobs, finish_reason))

    async def stream(self) -> AsyncIterator[dict[str, str]]:
        for c in self.choices:
            if self.echo[c.index]:
                yield self._chunk(c.index, self.echo[c.index], None, None)
        text_chunk = TextEvents(self._payload)
        async with contextlib.aclosing(merge_deltas(self.choices, self.run)) as deltas:
            async for index, delta in deltas:
                if delta.finish_reason is None and not self.plan.logprobs:
                    if delta.text:        # the common chunk: text alone
                        yield text_chunk(index, delta.text)
                    continue
                logprobs = self.logprobs[index].format(delta) if self.plan.logprobs else None
                yield self._chunk(index, delta.text, logprobs, delta.finish_reason)
        if self.plan.include_usage:
            yield event({**self.header, "object": "text_completion", "system_fingerprint": None,
                         "choices": [],
                         "usage": usage(self.prompt_tokens, self._completion_tokens())})
        yield DONE

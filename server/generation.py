"""Running the choices of one HTTP request on the engine.

An HTTP request becomes `len(prompts) * n` engine requests ("choices"), all submitted
before the response starts so that any refusal is still a JSON error. Their deltas
are then merged into one async stream of `(choice_index, ChoiceDelta)`, which both
the SSE writer and the non-streaming collector consume:

    submit_choices()  ->  [Choice, ...]          every engine request queued (or 4xx)
    merge_deltas()    ->  (index, delta), ...    in arrival order, across choices
    (on exit, early or not: every unfinished engine request is cancelled, and each
     choice is accounted for in the metrics and the request's log record)

A request that outlives `request_timeout_s` (counted from its arrival) ends with
RequestTimedOut: a 504 before the response starts, an in-band error in a stream.

A client that goes away mid-request must not leave work running: an SSE response
(sse.py) cancels its stream when the client disconnects; non-streaming ones race the
work against `wait_for_disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar

import orjson
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.types import Receive

from engine.outputs import GenerationOutput

from .async_engine import EngineDeadError, RequestStream, is_failed
from .text_pipeline.choice_decoder import ChoiceDecoder, ChoiceDelta
from .edge.errors import OpenAIError
from .request_log import RequestRecord, request_record
from .sampling import GenerationPlan
from .state import ServingState

T = TypeVar("T")


class GenerationFailed(OpenAIError):
    """The engine reported a failed request (after it had been accepted)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Generation failed: {message}", status_code=500,
                         type="server_error", code="generation_failed")


class ServerShuttingDown(OpenAIError):
    """The server's drain window closed before the request finished; its engine
    requests were cancelled."""

    def __init__(self) -> None:
        super().__init__("The server is shutting down and could not finish this request.",
                         status_code=503, code="server_shutting_down")


class RequestTimedOut(OpenAIError):
    """The request ran past `request_timeout_s`; its engine requests were cancelled."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The request did not finish within the server's timeout of "
                         f"{timeout_s:g} s and was cancelled.", status_code=504,
                         type="timeout_error", code="request_timeout")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    stream: RequestStream
    decoder: ChoiceDecoder
    last_output: GenerationOutput | None = None
    failed: bool = False

    def outcome(self, engine_failed: bool = False) -> str:
        """vLLM's finished_reason: stop | length, abort (cancelled) or error (the
        engine failed it, or failed a sibling choice of the same HTTP request)."""
        if self.decoder.finish_reason is not None:
            return self.decoder.finish_reason
        return "error" if self.failed or engine_failed else "abort"


@dataclass
class GenerationRun:
    """What one HTTP request's generation reports to: its log record, the server's
    metrics, and its deadline."""

    state: ServingState
    record: RequestRecord
    deadline: float | None
    """perf_counter time past which the request is cancelled; None = no limit."""

    def _limits(self):
        return [(at, error) for at, error in
                ((self.deadline, lambda: RequestTimedOut(self.state.settings.request_timeout_s)),
                 (self.state.engine.drain_deadline, ServerShuttingDown)) if at is not None]

    def check(self) -> None:
        """Raise RequestTimedOut once the request's deadline has passed,
        ServerShuttingDown once a shutdown's drain deadline has (the earlier first);
        its streams call it as they wait (async_engine.StreamLimits)."""
        passed = [(at, error) for at, error in self._limits() if time.perf_counter() >= at]
        if passed:
            raise min(passed, key=lambda limit: limit[0])[1]()

    def seconds_to_check(self) -> float:
        """Until the next deadline, and at most DRAIN_POLL_S, so that a drain that
        starts meanwhile is noticed."""
        now = time.perf_counter()
        return min([DRAIN_POLL_S] + [at - now for at, _ in self._limits()])

    def on_delta(self, index: int, delta: ChoiceDelta) -> None:
        if self.state.settings.log_prompts and delta.text:
            self.record.add_output_text(index, delta.text)

    def finish(self, choices: list[Choice], error: BaseException | None) -> None:
        """Account for every choice once the generation is over, however it ended."""
        record = self.record
        engine_failed = isinstance(error, (GenerationFailed, EngineDeadError))
        record.completion_tokens = sum(c.decoder.num_generated for c in choices)
        record.finish_reasons = sorted({c.outcome(engine_failed) for c in choices})
        if isinstance(error, OpenAIError):
            record.error_code = error.code
        for choice in choices:
            output = choice.last_output
            if output is not None:
                record.draft_tokens += output.num_draft_tokens
                record.accepted_tokens += output.num_accepted_tokens
            if output is not None and output.timestamps:
                first = output.timestamps[0]
                if record.first_token_time is None or first < record.first_token_time:
                    record.first_token_time = first
            if self.state.metrics is not None:
                self.state.metrics.observe_request(output, len(choice.prompt_ids),
                                                   choice.decoder.num_generated,
                                                   choice.outcome(engine_failed))


def start_run(request: Request, state: ServingState) -> GenerationRun:
    record = request_record(request)
    timeout = state.settings.request_timeout_s
    deadline = None if timeout is None else record.arrival + timeout
    return GenerationRun(state, record, deadline)


def submit_choices(state: ServingState, response_id: str, prompts: list[list[int]],
                   plan: GenerationPlan) -> list[Choice]:
    """Queue n engine requests per prompt; on any refusal cancel those already queued."""
    choices: list[Choice] = []
    try:
        for prompt_index, prompt_ids in enumerate(prompts):
            max_new_tokens = plan.max_new_tokens(len(prompt_ids), state.max_model_len)
            for i in range(plan.n):
                index = prompt_index * plan.n + i
                stream = state.engine.submit(
                    f"{response_id}-{index}", prompt_ids, max_new_tokens=max_new_tokens,
                    streaming=plan.engine_streaming, eos_token_id=plan.eos_token_ids,
                    sampling=plan.sampling_for_choice(index))
                decoder = ChoiceDecoder(state.tokenizer, prompt_ids, plan.stop_strings,
                                        plan.eos_token_ids, want_logprobs=plan.logprobs)
                choices.append(Choice(index, prompt_index, prompt_ids, stream, decoder))
    except BaseException:
        cancel_all(choices)
        raise
    return choices


def cancel_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.stream.cancel()


async def _choice_deltas(choice: Choice) -> AsyncIterator[ChoiceDelta]:
    async for output in choice.stream:
        choice.last_output = output
        if is_failed(output):
            choice.failed = True
            raise GenerationFailed(output.error or "unknown engine error")
        delta = choice.decoder.step(output)
        if not delta.is_empty():
            yield delta
        if delta.finish_reason is not None:
            choice.stream.cancel()  # a stop string ended it early; no-op otherwise
            return


async def merge_deltas(choices: list[Choice],
                       run: GenerationRun) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """All choices' deltas as they come. One choice is read right here; several are
    pumped by a task each into one queue. The run's deadlines end the streams as they
    wait (RequestStream.limits). Leaving the loop early (error, timeout, disconnect,
    consumer stops) cancels the pumps and every unfinished engine request."""
    for choice in choices:
        choice.stream.limits = run
    failure: BaseException | None = None
    tasks: list[asyncio.Task] = []
    try:
        if len(choices) == 1:
            async for delta in _choice_deltas(choices[0]):
                run.on_delta(choices[0].index, delta)
                yield choices[0].index, delta
            return
        queue: asyncio.Queue[tuple[int, ChoiceDelta | None, BaseException | None]] = \
            asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in _choice_deltas(choice):
                    queue.put_nowait((choice.index, delta, None))
                queue.put_nowait((choice.index, None, None))
            except Exception as exc:  # handed to the consumer, re-raised there
                queue.put_nowait((choice.index, None, exc))

        tasks = [asyncio.create_task(pump(choice)) for choice in choices]
        remaining = len(tasks)
        while remaining:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            run.on_delta(index, delta)
            yield index, delta
    except BaseException as exc:
        failure = exc
        raise
    finally:
        for task in tasks:
            task.cancel()
        cancel_all(choices)
        run.finish(choices, failure)


DRAIN_POLL_S = 0.25
"""How often a waiting request looks whether a shutdown has set a drain deadline."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has closed the connection (the body is already read,
    so the only message left to receive is the disconnect). `receive`: the ASGI
    callable (a Request's `receive`)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ArraysResponse(JSONResponse):
    """A JSON body encoded by orjson, for answers made of long arrays (embeddings,
    token ids): Python's json holds the event loop, which every stream on the server
    waits out, about ten times longer (docs/architecture.md); the text is the same
    (shortest float reprs, compact separators, UTF-8)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


async def json_until_disconnect(request: Request, work: Awaitable[dict],
                                response_class: type[JSONResponse] = JSONResponse) -> Response:
    """The JSON body `work` makes, or a 499 when the client left first (its choices
    are then cancelled by the caller's cleanup)."""
    try:
        return response_class(await run_until_disconnect(request, work))
    except ClientDisconnected:
        return Response(status_code=499)


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (raising ClientDisconnected) if the client leaves."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work_task
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

"""AsyncEngine: the asyncio face of the ContinuousBatchingManager.

The manager runs its own thread; the server runs an asyncio loop. They meet in one
`asyncio.Queue` per request:

    submit():   queue = asyncio.Queue()
                manager.register_result_handler(rid, queue.put_nowait)   # first, so no
                manager.add_request(prompt, rid, ...)                    # output is lost
    engine thread:  loop.call_soon_threadsafe(queue.put_nowait, output)  # per token, or once
    RequestStream:  await queue.get() ... until the output is finished

Whoever stops listening early (a client disconnect, a stop string, an error) calls
`RequestStream.cancel()`, which tells the engine to drop the request and free its KV
blocks.

A waiting stream sets no timer per token: one timer at a time puts a tick in its
queue (every LIVENESS_POLL_S, or sooner when its `limits` ask), and the tick is where
it checks that the engine thread lives and that no deadline has passed. The timers
the event loop runs grow with the streams, not with their tokens.

`submit` is synchronous on purpose: every way the engine can refuse a request
surfaces before an HTTP response (or SSE stream) has started, as a proper 4xx/503.

Lifecycle, as the probes see it:

    start() -> warmup() -> ready ... begin_drain() (SIGTERM) -> shutdown()
    ready():  warm, not draining, engine thread alive      (GET /ready)
    alive():  engine thread alive                          (GET /health)

If the engine thread dies (an exception in a step), the engine fails every request
it holds with a FAILED output (the server answers 500), and `is_running()` turns
false: new requests get 503 and /health goes red.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from engine.errors import (InvalidRequestError, ManagerStoppedError, QueueFullError,
                           RequestTooLongError)
from engine.outputs import GenerationOutput, RequestStatus

from .edge.errors import OpenAIError, bad_request

# How often a waiting stream checks that the engine thread is still alive, so that a
# dead engine gives a 5xx instead of a request that hangs forever.
LIVENESS_POLL_S = 1.0
# Seconds a client refused with 429 (queue full) is told to wait before retrying.
RETRY_AFTER_S = 1


class EngineDeadError(OpenAIError):
    """The engine thread stopped while a request was waiting for output."""

    def __init__(self) -> None:
        super().__init__("The engine stopped while generating this request.",
                         status_code=500, type="server_error", code="engine_dead")


class StreamLimits(Protocol):
    """What else may end a stream while it waits (generation.py's GenerationRun)."""

    def check(self) -> None:
        """Raise an OpenAIError once the stream must end (a deadline passed)."""

    def seconds_to_check(self) -> float:
        """How soon the next check is due."""


_TICK = object()
"""Queue item that only wakes a waiting stream for its checks."""


class RequestStream:
    """The outputs of one engine request, as an async iterator.

    Yields each GenerationOutput; the last one has `is_finished()` true. A FAILED
    output is yielded like any other (failures are data here; the consumer checks
    `status`). A dead engine thread raises EngineDeadError; `limits`, when set, may
    raise too (checked at least every LIVENESS_POLL_S while the stream waits).
    """

    def __init__(self, engine: "AsyncEngine", request_id: str,
                 queue: asyncio.Queue[GenerationOutput]) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self.limits: StreamLimits | None = None
        self._tick: asyncio.TimerHandle | None = None
        """The pending timer that will put _TICK in the queue, if any."""

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GenerationOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._next_output()
        if output.is_finished():
            self.finished = True
            self._stop_ticking()
        return output

    async def _next_output(self) -> GenerationOutput:
        while True:
            if self._queue.empty():
                self._arm_tick()
                item = await self._queue.get()
            else:
                item = self._queue.get_nowait()
            if item is not _TICK:
                return item
            self._tick = None
            if not self._engine.manager.is_running():
                # The thread has ended, so it scheduled its last outputs (a crash fails
                # every request it held) before: one turn of the loop queues them. A
                # crashed thread still failing its requests is waited for, not raced.
                await asyncio.sleep(0)
                if self._queue.empty():
                    self.finished = True
                    raise EngineDeadError()
                continue
            if self.limits is not None:
                self.limits.check()

    def _arm_tick(self) -> None:
        if self._tick is None:
            delay = LIVENESS_POLL_S if self.limits is None else \
                max(0.0, min(LIVENESS_POLL_S, self.limits.seconds_to_check()))
            self._tick = asyncio.get_running_loop().call_later(
                delay, self._queue.put_nowait, _TICK)

    def _stop_ticking(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def cancel(self) -> None:
        """Drop the request in the engine if it is still running. Idempotent."""
        self._stop_ticking()
        if not self.finished:
            self.finished = True
            self._engine.manager.cancel_request(self.request_id)


class AsyncEngine:
    """Owns the manager for the server's lifetime: start, submit, cancel, stop."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.warm = False
        self.draining = False
        self.drain_deadline: float | None = None
        """perf_counter time at which requests still running are cut (in-band 503
        plus [DONE] for streams), just before the server's drain window closes."""

    def start(self) -> None:
        self.manager.start()

    def warmup(self) -> None:
        """One dummy forward pass, so the first real request does not pay for lazy
        initialisation; blocking (call it from a worker thread)."""
        self.manager.warmup()
        self.warm = True

    def begin_drain(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests (503) from now on; running ones continue, for at most
        `drain_timeout_s` less a margin to deliver their error (None: no limit)."""
        self.draining = True
        if drain_timeout_s is not None:
            margin = min(1.0, 0.1 * drain_timeout_s)
            self.drain_deadline = time.perf_counter() + drain_timeout_s - margin

    def ready(self) -> bool:
        return self.warm and not self.draining and self.is_running()

    def stop(self, timeout: float | None = 10.0, hard: bool = False) -> None:
        """Stop accepting requests and end the engine thread: after the running ones
        finish, or at once when `hard` (they then end as FAILED)."""
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=timeout, hard_stop=hard)

    def shutdown(self) -> None:
        """Hard stop, then free the KV cache. The manager cannot restart afterwards."""
        self.stop(hard=True)
        self.manager.destroy()

    def is_running(self) -> bool:
        """The engine thread runs and has not crashed (a crashed thread may linger a
        while, e.g. telling tensor-parallel followers to stop)."""
        return self.manager.is_running() and self.manager.error is None

    def stats(self) -> dict[str, int]:
        return dict(self.manager.stats())

    def compile_grammar(self, spec):
        """Any thread (the routes call it off the event loop): a CompiledGrammar,
        or InvalidRequestError naming what is wrong with `spec`."""
        return self.manager.compile_grammar(spec)

    def submit(self, request_id: str, prompt_ids: list[int], *, max_new_tokens: int,
               streaming: bool, eos_token_id: list[int],
               sampling: dict[str, Any], pooling: Any = None) -> RequestStream:
        """Queue one request; must run on the event loop thread (the handler is bound
        to the running loop). Raises OpenAIError when the engine refuses it.
        `pooling` (an engine Pooling): an embedding request."""
        if self.draining:
            raise OpenAIError("The server is shutting down.", status_code=503,
                              code="server_shutting_down")
        if not self.is_running():
            raise OpenAIError("The engine is not running.", status_code=503,
                              code="engine_stopped")
        queue: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        self.manager.register_result_handler(request_id, queue.put_nowait)
        try:
            # Timestamps feed the latency metrics (TTFT, inter-token latency).
            accepted = self.manager.add_request(
                prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                streaming=streaming, record_timestamps=True, eos_token_id=eos_token_id,
                **sampling, **({} if pooling is None else {"pooling": pooling}))
        except RequestTooLongError as exc:
            self.manager.cancel_request(request_id)
            raise bad_request(str(exc), param="max_tokens", code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            self.manager.cancel_request(request_id)
            raise bad_request(str(exc), code="invalid_value") from None
        except QueueFullError as exc:
            self.manager.cancel_request(request_id)
            raise OpenAIError(f"Too many requests are queued; retry shortly ({exc}).",
                              status_code=429, code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ManagerStoppedError as exc:
            self.manager.cancel_request(request_id)
            raise OpenAIError(f"The server is shutting down: {exc}",
                              status_code=503, code="server_busy") from None
        if accepted is None:  # the manager logs and refuses once it has been stopped
            self.manager.cancel_request(request_id)
            raise OpenAIError("The server is shutting down.", status_code=503,
                              code="server_busy")
        return RequestStream(self, request_id, queue)


def is_failed(output: GenerationOutput) -> bool:
    return output.status == RequestStatus.FAILED

"""EncoderManager: the embedding subset of the ContinuousBatchingManager's API over an
encoder (model.py), for the server's /v1/embeddings.

    add_request(ids, request_id, pooling=Pooling(...))   any thread; refuses
        requests without a pooling (an encoder generates nothing) or with `classify`
    engine thread:  block on the inbox -> take every waiting request
                    -> batches within max_batch_tokens (batching.token_groups)
                    -> encode each, deliver each request's one finished output
    cancel_request, register_result_handler, get_result   as the manager's
    start / warmup / stop / destroy / is_running / error / stats

Requests cross into the thread only through the inbox and come back as immutable
GenerationOutputs through the same OutputRouter the paged engine uses. A crash in a
step fails every request the thread holds and ends it (`error` says why).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidRequestError, QueueFullError, RequestTooLongError
from ..core.output_router import OutputRouter
from ..outputs import GenerationOutput, RequestStatus
from ..pooling import Pooling
from .batching import encode_batch, token_groups

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 8192
"""Padded tokens per encoder batch when the config sets none."""
_STOP = object()
"""Inbox item: end the thread once the requests queued before it are done."""


@dataclass(frozen=True)
class EncoderRequest:
    request_id: str
    prompt_ids: list[int]
    pooling: Pooling
    created_time: float


class EncoderManager:
    def __init__(self, model, max_batch_tokens: int | None = None,
                 max_queue_size: int = 0) -> None:
        self.model = model
        self.max_batch_tokens = max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        self.max_queue_size = max_queue_size
        self.num_labels = None
        """No sequence-classification head (manager.ContinuousBatchingManager's field)."""
        self.router = OutputRouter()
        self.error: BaseException | None = None
        self.warmed_up = False
        self._inbox: queue.Queue = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._accepting = True
        self._hard_stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._num_waiting = 0
        self._num_running = 0
        self._num_steps = 0
        self._num_tokens = 0

    # -- submitting (any thread) ----------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None,
                    max_new_tokens: int | None = None, streaming: bool = False,
                    record_timestamps: bool = False, eos_token_id: Any = None,
                    pooling: Pooling | None = None, **sampling: Any) -> str | None:
        """Queue one embedding request; returns its id (None once stopped). The
        generation arguments are accepted for the manager's signature and unused."""
        if pooling is None or not isinstance(pooling, Pooling):
            raise InvalidRequestError("this model is an encoder (an embedding model): it "
                                      "takes pooling requests only")
        if pooling.classify:
            raise InvalidRequestError("pooling.classify: this model has no sequence-"
                                      "classification head")
        ids = [int(token) for token in input_ids]
        if not ids or len(ids) > self.model.max_context:
            raise RequestTooLongError(f"an input needs 1 to {self.model.max_context} tokens, "
                                      f"got {len(ids)}")
        request_id = request_id or f"req_{next(self._ids)}"
        with self._lock:
            if not self._accepting or self.error is not None:
                logger.warning("encoder is not running: request %s refused", request_id)
                return None
            if self.max_queue_size and self._num_waiting >= self.max_queue_size:
                raise QueueFullError(f"{self.max_queue_size} requests already wait "
                                     "(max_queue_size)")
            self._num_waiting += 1
            self._inbox.put(EncoderRequest(request_id, ids, pooling, time.time()))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        """Any thread: no output is delivered for it; it is skipped if not yet run."""
        self.router.cancel(request_id)
        with self._lock:
            self._cancelled.add(request_id)

    def register_result_handler(self, request_id: str,
                                callback: Callable[[GenerationOutput], None]) -> None:
        self.router.register(request_id, callback)

    def get_result(self, request_id: str | None = None,
                   timeout: float | None = None) -> GenerationOutput | None:
        return self.router.get(request_id, timeout if self.is_running() else None,
                               block=self.is_running())

    def compile_grammar(self, spec):
        raise InvalidRequestError("this model is an encoder (an embedding model): it takes "
                                  "no grammar")

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running():
            return
        self.error, self._accepting, self._hard_stop = None, True, False
        self._thread = threading.Thread(target=self._run, name="kvserve-encoder", daemon=True)
        self._thread.start()

    def warmup(self) -> None:
        """One tiny batch on the calling thread (the first step's one-off costs)."""
        encode_batch(self.model.module, [[self.model.pad_token_id] * 4], [Pooling("mean")],
                     self.model.pad_token_id, self.model.device)
        self.warmed_up = True

    def stop(self, block: bool = True, timeout: float | None = None,
             keep_for_next_session: bool = False, hard_stop: bool = False) -> None:
        """Refuse new requests; run the queued ones first unless `hard_stop` (they then
        end as FAILED)."""
        with self._lock:
            self._accepting = False
            self._hard_stop = self._hard_stop or hard_stop
        self._inbox.put(_STOP)
        if block and self._thread is not None:
            self._thread.join(timeout)

    def destroy(self) -> None:
        self.stop(block=True, hard_stop=True)

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """The keys of the paged engine's stats (engine_loop.EngineLoop.stats) a
        server reads; an encoder holds no KV cache and drafts nothing: those are 0."""
        with self._lock:
            waiting, running = self._num_waiting, self._num_running
        return {"num_running": running, "num_waiting": waiting, "num_steps": self._num_steps,
                "num_prefill_tokens": self._num_tokens, "num_blocks": 0, "num_free_blocks": 0,
                "num_cached_blocks": 0, "num_preemptions": 0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_evictions": 0, "num_swapped_out": 0,
                "num_swapped_in": 0, "spec_decode": 0, "spec_num_drafts": 0,
                "spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0}

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        pending: list[EncoderRequest] = []
        try:
            while True:
                pending, stopping = self._take(block=True)
                self._encode(pending)
                pending = []
                if stopping:
                    break
        except BaseException as error:   # the thread's end: every request it holds fails
            logger.exception("encoder thread crashed")
            self.error = error
            self._fail(pending + self._take(block=False)[0], f"{type(error).__name__}: {error}")
        finally:
            with self._lock:
                self._accepting = False
        if self._hard_stop:
            self._fail(self._take(block=False)[0], "the encoder was stopped")

    def _take(self, block: bool) -> tuple[list[EncoderRequest], bool]:
        """Every request waiting in the inbox (blocking for the first when `block`),
        and whether a stop came with them."""
        taken, stopping = [], False
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is _STOP:
                    stopping = True
                else:
                    taken.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            self._num_waiting -= len(taken)
            self._num_running += len(taken)
        return taken, stopping

    def _encode(self, requests: list[EncoderRequest]) -> None:
        if self._hard_stop:
            self._fail(requests, "the encoder was stopped")
            return
        live = [r for r in requests if r.request_id not in self._drop_cancelled()]
        with self._lock:
            self._num_running -= len(requests) - len(live)
        for group in token_groups([len(r.prompt_ids) for r in live], self.max_batch_tokens):
            batch = [live[i] for i in group]
            vectors = encode_batch(self.model.module, [r.prompt_ids for r in batch],
                                   [r.pooling for r in batch], self.model.pad_token_id,
                                   self.model.device)
            self._num_steps += 1
            self._num_tokens += sum(len(r.prompt_ids) for r in batch)
            with self._lock:
                self._num_running -= len(batch)
            self.router.deliver_all([_finished(r, v) for r, v in zip(batch, vectors)])

    def _drop_cancelled(self) -> set[str]:
        """The ids cancelled so far, forgotten here and in the router: each request is
        queued before its cancel, so every one of them has been taken by now."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            self.router.forget(request_id)
        return cancelled

    def _fail(self, requests: list[EncoderRequest], message: str) -> None:
        with self._lock:
            self._num_running -= len(requests)
        self.router.deliver_all([GenerationOutput(r.request_id, r.prompt_ids, [],
                                                  RequestStatus.FAILED, error=message,
                                                  created_time=r.created_time)
                                 for r in requests])


def _finished(request: EncoderRequest, vector: list[float]) -> GenerationOutput:
    return GenerationOutput(request.request_id, request.prompt_ids, [], RequestStatus.FINISHED,
                            finish_reason="stop", created_time=request.created_time,
                            embedding=vector)

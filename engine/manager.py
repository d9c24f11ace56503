"""ContinuousBatchingManager: the public face of the engine, with the interface of
transformers' continuous-batching API. A manager is configured by a
ContinuousBatchingConfig (config.py); callers `add_request` / `add_requests`, then read
results with `get_result`, `request_id_iter` or a result handler, and `cancel_request`;
`start`, `stop`, `join` and `warmup` drive the engine thread. `generate_batch`
(model_api.py) runs a whole batch through one manager. docs/configuration.md, "The
engine as a library", shows both.

Callers (any thread) submit requests and read results; one background thread owns
every request, the scheduler and the runner, and loops:

    drain the inbox -> schedule -> run the model and sample -> update -> deliver

blocking on the inbox when there is nothing to do. Requests cross into the engine
thread only through the inbox; only immutable GenerationOutputs come back out.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterator

from .config import ContinuousBatchingConfig
from .kernels.cpu_threads import release_openmp_pool
from .core.engine_loop import EngineLoop
from .errors import InvalidRequestError, QueueFullError, RequestTooLongError
from .generation_config import GenerationConfig, SamplingParams, resolve_eos
from .structured.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from .kv_cache.kv_events import KVEventSink
from .outputs import GenerationOutput
from .pooling import Pooling
from .core.output_router import OutputRouter
from .core.requests import RequestState

logger = logging.getLogger(__name__)

QUEUE_WAIT_S = 10.0
"""`add_requests` waits this long for room in a full queue (max_queue_size) before
QueueFullError, as transformers' blocking put does."""


class ContinuousBatchingManager:
    """Built by `EngineModel.init_continuous_batching` (or `generate_batch`), not by
    users directly."""

    def __init__(self, model, generation_config: GenerationConfig | None,
                 continuous_batching_config: ContinuousBatchingConfig | None,
                 workload_hints: dict | None = None) -> None:
        self.model = model
        self.generation_config = GenerationConfig.from_any(generation_config)
        self.config = ContinuousBatchingConfig.from_any(continuous_batching_config)
        self.default_sampling = SamplingParams.from_generation_config(self.generation_config)
        self.router = OutputRouter()
        self.loop = EngineLoop(model, self.config, self.router, workload_hints or {},
                               logit_processing=not self.default_sampling.is_greedy
                               or self.config.per_request_processors)
        self.sizing = self.loop.sizing
        self._thread: threading.Thread | None = None
        self._accepting = True
        """Requests are queued from construction (the thread serves them once started)
        until `stop` or `destroy`."""
        self._destroyed = False
        self.warmed_up = False
        """`warmup()` ran: the entry points do not warm a reused (persistent) manager again."""
        self._ids = itertools.count()
        self.vocab_size = int(model.config.vocab_size)
        spec = model.module.engine_spec()
        self.max_context = spec.max_context
        self.num_labels = spec.num_labels
        """A sequence classifier's labels (model_spec.py): it takes pooling requests
        only. None: a causal LM, which takes no classifying ones."""
        self.grammars: GrammarCompiler = model.grammars
        """Compiles `grammar=` specs against the model's tokenizer (grammar.py)."""

    # -- submitting ------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None,
                    max_new_tokens: int | None = None, streaming: bool = False,
                    record_timestamps: bool = False, eos_token_id: int | list[int] | None = None,
                    **logit_processor_kwargs: Any) -> str | None:
        """Any thread. Queue one request (before `start` too); returns its id, or None
        (with a warning) once the manager is stopped. Raises InvalidRequestError,
        RequestTooLongError or QueueFullError (at once: a server answers 429) for
        requests that cannot be served. On a follower rank of a tensor-parallel run it
        queues nothing (the driver rank owns requests) and returns None.

        `grammar=` (among the keyword arguments, beside the sampling ones):
        constrained decoding; the output matches it (a GrammarSpec, or one compiled
        already by `compile_grammar` to share it across requests). `pooling=` (a
        Pooling): an embedding request, whose output carries `embedding` and no tokens
        (pooling.py)."""
        if not self.loop.is_driver:
            return None
        grammar = logit_processor_kwargs.pop("grammar", None)
        pooling = logit_processor_kwargs.pop("pooling", None)
        if pooling is not None and not isinstance(pooling, Pooling):
            raise InvalidRequestError(f"pooling: a Pooling, got {pooling!r}")
        if pooling is not None and grammar is not None:
            raise InvalidRequestError("pooling: an embedding request takes no grammar")
        self._check_head(pooling)
        request = self._make_request(input_ids, request_id,
                                     1 if pooling is not None else max_new_tokens, streaming,
                                     record_timestamps, eos_token_id, logit_processor_kwargs)
        request.pooling = pooling
        if grammar is not None:
            request.grammar = self._compiled(grammar).new_matcher(request.eos_token_ids)
        with self.loop.submit_lock:
            if not self._accepting or self.loop.error is not None:
                logger.warning("manager is not running: request %s refused", request.request_id)
                return None
            max_queue = self.config.max_queue_size
            if max_queue and self.loop.num_beyond_capacity() >= max_queue:
                raise QueueFullError(f"{max_queue} requests already wait beyond what the "
                                     "engine can admit now (max_queue_size)")
            self.loop.submit(request)
        return request.request_id

    def _check_head(self, pooling: Pooling | None) -> None:
        """A request the model's heads can answer: tokens from a causal LM only, label
        logits from a classifier only, vectors from both."""
        if self.num_labels is None and pooling is not None and pooling.classify:
            raise InvalidRequestError("pooling.classify: this model has no sequence-"
                                      "classification head")
        if self.num_labels is not None and pooling is None:
            raise InvalidRequestError("this model is a sequence classifier (no LM head): it "
                                      "takes pooling requests only")

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Any thread. Validate and compile a grammar once (InvalidRequestError naming
        what is wrong); the result may be passed to many `add_request` calls."""
        return self.grammars.compile(spec)

    def _compiled(self, grammar: GrammarSpec | CompiledGrammar) -> CompiledGrammar:
        if isinstance(grammar, CompiledGrammar):
            return grammar
        if isinstance(grammar, GrammarSpec):
            return self.grammars.compile(grammar)
        raise InvalidRequestError(f"grammar must be a GrammarSpec or CompiledGrammar, "
                                  f"got {type(grammar).__name__}")

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None,
                     streaming: bool = False, record_timestamps: bool = False,
                     **logit_processor_kwargs: Any) -> list[str]:
        """Any thread. Ids follow the order of `inputs`; with block sharing on, the
        requests are queued sorted by tokens so shared prefixes run back to back. Under
        `max_queue_size` it waits for room while the engine runs (QueueFullError once
        the queue has not moved for QUEUE_WAIT_S), so a batch larger than the queue
        goes through."""
        ids = [f"req_{next(self._ids)}" for _ in inputs]
        if logit_processor_kwargs.get("grammar") is not None:   # compiled once for all
            logit_processor_kwargs["grammar"] = self._compiled(logit_processor_kwargs["grammar"])
        order = range(len(inputs))
        if self.config.allow_block_sharing:
            order = sorted(order, key=lambda i: list(inputs[i]))
        for i in order:
            self._add_waiting_for_room(inputs[i], ids[i], max_new_tokens, streaming,
                                       record_timestamps, **logit_processor_kwargs)
        return ids

    def _add_waiting_for_room(self, *args: Any, **kwargs: Any) -> None:
        """`add_request(*args, **kwargs)`, retried while the queue is full and the
        engine runs, for up to QUEUE_WAIT_S."""
        deadline = time.monotonic() + QUEUE_WAIT_S
        while True:
            try:
                self.add_request(*args, **kwargs)
                return
            except QueueFullError:
                if not self.is_running() or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def _make_request(self, input_ids, request_id, max_new_tokens, streaming,
                      record_timestamps, eos_token_id, kwargs) -> RequestState:
        prompt = list(input_ids) if input_ids is not None else []
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(
                f"input_ids must be a non-empty list of token ids in [0, {self.vocab_size})")
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        total = len(prompt) + max_new_tokens
        if total > self.sizing.max_cached_tokens:
            raise RequestTooLongError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the KV cache ({self.sizing.max_cached_tokens} tokens)")
        if self.max_context and total > self.max_context:
            raise RequestTooLongError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the model's context length ({self.max_context})")
        sampling = self.default_sampling.with_overrides(kwargs, self.vocab_size)
        if request_id is None:
            request_id = f"req_{next(self._ids)}"
        return RequestState(
            request_id=str(request_id), prompt_ids=prompt, max_new_tokens=max_new_tokens,
            eos_token_ids=resolve_eos(self.generation_config.eos_token_id, eos_token_id),
            sampling=sampling, streaming=streaming, record_timestamps=record_timestamps,
            want_logprobs=self.config.return_logprobs or sampling.logprobs)

    def cancel_request(self, request_id: str) -> None:
        """Any thread. The request is dropped and its blocks freed at the next step;
        no further output is delivered for it."""
        self.router.cancel(request_id)
        self.loop.cancel(request_id)

    # -- results -----------------------------------------------------------------------
    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call from the asyncio loop thread, before `add_request`: `callback` then runs
        on that loop (via call_soon_threadsafe) for each result of the request."""
        self.router.register(request_id, callback)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """Any thread. Next result from the shared queue (see OutputRouter.get); with
        the thread stopped (nothing more can arrive) it does not wait, whatever
        `timeout` says."""
        if not self.is_running():
            return self.router.get(request_id, None, block=False)
        return self.router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or self.router.has_pending():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Blocking iteration over one request's results, ending with its last, or,
        once the thread has stopped, when a pass over the queue finds none of them
        (an unknown, cancelled or already consumed id)."""
        misses = 0      # heads of other requests put back since the thread stopped
        while self.is_running() or misses <= self.router.num_pending():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is None:
                if self.is_running():
                    time.sleep(0.001)  # the head belonged to another request
                else:
                    misses += 1
                continue
            misses = 0
            yield result
            if result.is_finished():
                return

    # -- lifecycle -----------------------------------------------------------------------
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._destroyed:
            raise RuntimeError("this manager was destroyed and cannot be restarted")
        if self.is_running():
            if not self.loop.stop_requested:
                return
            self._thread.join()          # a stop(block=False) is still winding down
        self.loop.reset_stop_flags()
        self._thread = threading.Thread(target=self.loop.run, name="kvserve-engine", daemon=True)
        self._accepting = True
        release_openmp_pool()   # else this thread's OpenMP helpers slow the engine's ops
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None,
             keep_for_next_session: bool = False, hard_stop: bool = False) -> None:
        """Refuse new requests; by default let queued and running ones finish, then end
        the thread. `hard_stop` fails them (RuntimeError) and ends it at once. Called
        inside `pause()`, it does not wait: the thread ends once the pause is over."""
        with self.loop.submit_lock:
            self._accepting = False
            self.loop.request_stop(hard=hard_stop)
        if block and self.loop.pause_gate.holds():
            logger.warning("stop() inside pause(): the engine stops when the pause ends")
        elif block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            self.model.keep_manager(self)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if stop_trigger_time is not None and not self._thread.is_alive():
                logger.debug("engine thread joined %.3fs after stop", time.perf_counter() - stop_trigger_time)

    def destroy(self) -> None:
        """Stop if running and free the cache. Idempotent; no restart afterwards."""
        if self._destroyed:
            return
        if self.loop.pause_gate.holds():
            raise RuntimeError("destroy() cannot be called inside pause()")
        self._accepting = False
        if self.is_running():
            self.stop(block=True)
        self.loop.release()
        self._destroyed = True
        self.model.forget_manager(self)

    @contextlib.contextmanager
    def pause(self):
        """Pause the loop between steps so the caller can use or update the model in
        place; in-flight requests and the cache are kept. Re-entrant across threads:
        the loop resumes when the last holder exits."""
        self.loop.pause_gate.acquire(wait=self.is_running)
        try:
            yield self
        finally:
            self.loop.pause_gate.release()

    def warmup(self) -> None:
        """Run a dummy batch through the model and record the decode CUDA graphs, where
        there are any (the decode fast path on CUDA, either backend)."""
        self.loop.warmup()
        release_openmp_pool()   # the dummy batch ran on this thread (see cpu_threads.py)
        self.warmed_up = True

    def switch_to_cb_friendly_attn(self, model=None, auto_switch_to_flash: bool = True) -> str:
        """The paged attention implementation the engine's steps take on `model` (this
        manager's by default): "flash" where asked for and it serves, else "torch". The
        engine chooses it per start (attention/backend.py) and leaves the model as it is."""
        from .attention.backend import choose_backend
        return choose_backend((model or self.model).module, auto_switch_to_flash).name

    @property
    def error(self) -> BaseException | None:
        """What crashed the engine thread, if anything did; cleared by start()."""
        return self.loop.error

    @property
    def is_driver(self) -> bool:
        """True unless this is a follower rank of a tensor-parallel run, where requests
        and results live on rank 0 only."""
        return self.loop.is_driver

    def publish_kv_events(self, sink: KVEventSink) -> None:
        """Any thread, before requests are added: call `sink` on the engine thread
        with each step's prefix-cache events (kv_cache/kv_events.py); it must not
        block. Only the driver rank of a tensor-parallel run has any."""
        self.loop.set_kv_event_sink(sink)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return self.loop.stats()

    def check_invariants(self) -> None:
        """Assert the block bookkeeping matches the live requests (tests)."""
        self.loop.check_invariants()

"""EngineLoop: the background thread's state and its loop.

    while not stopped:
        wait while paused
        drain the inbox (block when idle)   -> new requests, cancellations
        schedule                            -> ScheduledBatch
        run                                 -> sampled tokens
        update requests, deliver outputs
        hand the step's KV cache events to the sink, when one is set

Everything here runs on the engine thread except the methods marked "any thread",
which only touch the inbox, flags under locks, or read sizes. What the loop is built
from (cache sizing, scheduler, plans, runner) comes from engine_setup.py; pauses go
through pause_gate.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ..config import ContinuousBatchingConfig
from .async_steps import AsyncSteps
from .engine_setup import build_engine_parts
from ..errors import InvalidRequestError
from ..kv_cache.kv_events import KVEventLog, KVEventSink
from .output_router import OutputRouter
from ..outputs import RequestStatus
from .pause_gate import PauseGate
from ..step.pooling_step import add_part, embedding_of
from .requests import RequestState
from ..step.runner import LaunchedStep
from .scheduler import ScheduledBatch, ScheduledRequest
from ..speculative.acceptance import Verdict
from ..speculative.proposer import SpeculationCounts

logger = logging.getLogger(__name__)

_WAKE = object()   # inbox item that only wakes the loop up


WARMUP_TOKENS = 16
"""The warmup prefill's length. A full page (256 tokens) would add arithmetic to a
large model's CPU start that warms nothing a short prefill does not
(docs/benchmarks.md, Start-up and real-size models)."""


class EngineLoop:
    def __init__(self, model, config: ContinuousBatchingConfig, router: OutputRouter,
                 workload_hints: dict, logit_processing: bool) -> None:
        parts = build_engine_parts(model, config, workload_hints, logit_processing)
        self.step_sync, self.sizing = parts.step_sync, parts.sizing
        self.allocator, self.scheduler = parts.allocator, parts.scheduler
        self.decode_plan, self.runner = parts.decode_plan, parts.runner
        self.async_steps = AsyncSteps(self) if parts.async_batching else None
        """Async batching (async_steps.py): a step stays in flight between loop turns."""
        self.router = router
        self.times_drafts = config.seed is None
        """Whether decode steps' times decide how many drafts are taken (row_cost.py):
        not under an engine seed, whose sampled requests repeat themselves only while
        their drafts do not hang on the host's timing."""
        self.inbox: queue.Queue = queue.Queue()
        self.submit_lock = threading.Lock()
        """Held by callers around "may I submit? submit" and by stop/crash paths around
        closing the door, so no request slips into an inbox nobody will read."""
        self._count_lock = threading.Lock()
        self._num_submitted_unseen = 0
        self._live_ids: set[str] = set()
        self.step_lock = threading.Lock()
        self.pause_gate = PauseGate(wake=lambda: self.inbox.put(_WAKE))
        self._stop_requested = False
        self._hard_stop = False
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.error: BaseException | None = None
        self.kv_event_sink: KVEventSink | None = None
        """Receives each step's KV cache events (kv_cache/kv_events.py); None: none
        are recorded."""

    def set_kv_event_sink(self, sink: KVEventSink) -> None:
        """Any thread, before requests arrive: publish the prefix cache's events to
        `sink` from now on, starting with AllBlocksCleared (blocks indexed before are
        not announced: the subscriber starts from an empty cache)."""
        with self.step_lock:
            log = KVEventLog()
            log.cleared()
            self.allocator.events = log
            self.kv_event_sink = sink

    # -- any thread ----------------------------------------------------------------------
    def submit(self, request: RequestState) -> None:
        """Any thread, under `submit_lock`. Refuses an id that is still in flight."""
        with self._count_lock:
            if request.request_id in self._live_ids:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            self._live_ids.add(request.request_id)
            self._num_submitted_unseen += 1
        self.inbox.put(("add", request))

    def _forget(self, request_id: str) -> None:
        with self._count_lock:
            self._live_ids.discard(request_id)

    def cancel(self, request_id: str) -> None:
        self.inbox.put(("cancel", request_id))

    def num_pending(self) -> int:
        """Requests added and never scheduled yet (in the inbox or the waiting queue);
        preempted requests waiting to resume do not count."""
        never_scheduled = sum(1 for r in list(self.scheduler.waiting)
                              if r.first_scheduled_time is None)
        return self._num_submitted_unseen + never_scheduled

    def num_beyond_capacity(self) -> int:
        """Any thread. Requests added and never scheduled that the engine could not
        admit right now: walking the waiting queue then the inbox in order, each takes
        a batch slot and the blocks of its prompt while there are some free; those
        left over count (`max_queue_size` bounds them). Preempted requests waiting to
        resume take their share first but are not counted."""
        with self.inbox.mutex:
            unseen = [item[1] for item in self.inbox.queue
                      if item is not _WAKE and item[0] == "add"]
        slots = self.sizing.max_requests_per_batch - len(self.scheduler.running)
        free_blocks = self.allocator.num_free_blocks
        beyond = 0
        for request in list(self.scheduler.waiting) + unseen:
            needed = len(request.prompt_ids) // self.sizing.page_size + 1
            if slots > 0 and needed <= free_blocks:
                slots, free_blocks = slots - 1, free_blocks - needed
            elif request.first_scheduled_time is None:
                beyond += 1
        return beyond

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def reset_stop_flags(self) -> None:
        self._stop_requested = self._hard_stop = False
        self.error = None

    def request_stop(self, hard: bool) -> None:
        self._stop_requested = True
        self._hard_stop = self._hard_stop or hard
        self.inbox.put(_WAKE)

    def stats(self) -> dict[str, int]:
        graphs = self.runner.decode_graphs
        proposer = self.scheduler.proposer
        counts = proposer.counts if proposer is not None else SpeculationCounts()
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.num_pending(),
            "num_free_blocks": self.allocator.num_free_blocks,
            "num_blocks": self.allocator.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "prefix_cache_queries": self.scheduler.blocks.prefix_queried_tokens,
            "prefix_cache_hits": self.scheduler.blocks.prefix_hit_tokens,
            "num_swapped_out": self.scheduler.blocks.num_swapped_out,
            "num_swapped_in": self.scheduler.blocks.num_swapped_in,
            "num_sliding_blocks": self.sizing.num_sliding_blocks,
            "max_blocks_per_request": self.decode_plan.max_blocks_per_request,
            "decode_fast_path": int(self.decode_plan.tables is not None),
            "num_decode_graphs": len(graphs.graphs) if graphs else 0,
            "num_graph_steps": graphs.num_steps if graphs else 0,
            "num_compiled_steps": self.runner.num_compiled_steps,
            "async_batching": int(self.async_steps is not None),
            "num_lookahead_steps": self.async_steps.num_lookahead_steps if self.async_steps else 0,
            "num_free_sliding_blocks": (self.scheduler.blocks.sliding_allocator.num_free_blocks
                                        if self.scheduler.blocks.sliding_allocator else 0),
            "num_cached_blocks": self.allocator.num_cached_blocks,
            "num_evictions": self.allocator.num_evictions,
            "spec_decode": int(proposer is not None),
            "spec_num_drafts": counts.num_drafts,
            "spec_num_draft_tokens": counts.num_draft_tokens,
            "spec_num_accepted_tokens": counts.num_accepted_tokens,
            "spec_timed_steps": (sum(proposer.row_cost.samples.values())
                                 if proposer is not None else 0),
            **{f"spec_accepted_at_{position}": count
               for position, count in enumerate(counts.accepted_per_position)},
        }

    def check_invariants(self) -> None:
        with self.step_lock:
            self.scheduler.check_invariants()

    @property
    def is_driver(self) -> bool:
        """False only on a follower rank of a tensor-parallel run."""
        return self.step_sync is None or self.step_sync.is_driver

    def warmup(self) -> None:
        """Run one dummy prefill of WARMUP_TOKENS tokens through the model (the first
        step's one-off costs: thread pools, lazy buffers), then record the decode CUDA
        graphs when there are any (on a follower rank: nothing, it runs the driver's
        warmup step)."""
        if not self.is_driver:
            return
        with self.step_lock:
            num_tokens = min(WARMUP_TOKENS, self.sizing.page_size, self.sizing.max_batch_tokens)
            dummy = RequestState("__warmup__", [0] * num_tokens, 1, (), sampling=_greedy_params())
            blocks = self.scheduler.blocks
            if not blocks.grow(dummy, num_tokens):
                return
            try:
                self.runner.step(ScheduledBatch([ScheduledRequest(dummy, 0, num_tokens, True)], []))
            finally:
                blocks.release(dummy)
            self.runner.capture_graphs()

    def release(self) -> None:
        self.runner.grammar_masks.close()
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.release()
        self.runner.cache.release()
        if self.runner.offload_cache is not None:
            self.runner.offload_cache.release()
        if self.runner.device.type == "cuda":    # the next manager's sizing sees it free
            torch.cuda.empty_cache()

    # -- engine thread -------------------------------------------------------------------
    def run(self) -> None:
        if not self.is_driver:
            try:
                self.runner.follow()
            except BaseException as error:   # a dead driver: the control group timed out
                logger.exception("follower rank failed")
                self.error = error
            return
        try:
            while True:
                if self.pause_gate.wanted() or self._hard_stop:
                    self._drain_pipeline()     # nothing in flight while parked or failing
                self.pause_gate.park_while_held(lambda: self._hard_stop,
                                                self._keep_followers_waiting)
                self._drain_inbox(block=not self.scheduler.has_work())
                self._keep_followers_waiting()
                if self._hard_stop:
                    self._fail_all("RuntimeError: the manager was hard-stopped")
                    return
                if self._stop_requested and not self.scheduler.has_work() and self.inbox.empty():
                    return
                if self.scheduler.has_work() and self.async_steps is not None:
                    self.async_steps.step()
                elif self.scheduler.has_work():
                    self._step()
                self._publish_kv_events()
        except BaseException as error:  # fail every request, never leave callers hanging
            logger.exception("engine thread crashed")
            with self.submit_lock:      # from here on add_request refuses
                self.error = error
            self._fail_all(f"engine error: {error!r}")
        finally:
            self._stop_followers()

    def _publish_kv_events(self) -> None:
        """Hand the events of the steps just run to the sink (outside `step_lock`:
        the events are recorded on this thread only)."""
        log = self.allocator.events
        if log is not None:
            events = log.drain()
            if events:
                self.kv_event_sink(events)

    def _drain_pipeline(self) -> None:
        if self.async_steps is not None:
            self.async_steps.drain()

    def _keep_followers_waiting(self) -> None:
        if self.step_sync is not None:
            self.step_sync.send_idle_if_due()

    def _stop_followers(self) -> None:
        if self.step_sync is None:
            return
        try:
            self.step_sync.send_stop()
        except Exception:   # a follower died: its peers fail on their own timeout
            logger.exception("could not tell the follower ranks to stop")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if item is _WAKE:
            return
        kind, payload = item
        if kind == "add":
            with self._count_lock:
                self._num_submitted_unseen -= 1
        else:        # a cancelled request's blocks may be written by the step in flight
            self._drain_pipeline()
        with self.step_lock:
            if kind == "add":
                self.runner.sampler.init_request(payload)
                self.scheduler.add(payload)
            elif kind == "cancel":
                self.scheduler.remove(payload)
                self.router.forget(payload)
                self._forget(payload)

    def _step(self) -> None:
        with self.step_lock:
            batch = self.scheduler.schedule()
            if batch is None:
                return
            started = time.perf_counter()
            news = self.collect(self.launch(batch))
            self._time_decode_step(batch, time.perf_counter() - started)
        self.deliver(news)

    def _time_decode_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A decode-only step's rows and seconds to the proposer (what a draft's row
        costs: speculative/row_cost.py)."""
        proposer = self.scheduler.proposer
        if proposer is not None and self.times_drafts and batch.entries and all(
                e.num_tokens == 1 + len(e.drafts) for e in batch.entries):
            proposer.record_step(sum(e.num_tokens for e in batch.entries), seconds)

    def launch(self, batch: ScheduledBatch, inputs=None) -> LaunchedStep:
        """Queue `batch` on the device (runner.launch) and count it: its requests'
        computed tokens move to the batch's end. Under `step_lock`."""
        launched = self.runner.launch(batch, inputs)
        self.num_steps += 1
        for entry in batch.entries:
            entry.request.num_computed_tokens = entry.end     # verify entries: see collect
            fed = entry.num_tokens - len(entry.drafts)
            if fed > 1 or entry.start < len(entry.request.prompt_ids):
                self.num_prefill_tokens += fed
        return launched

    def collect(self, launched: LaunchedStep, keep_blocks: set[int] = frozenset()
                ) -> list[RequestState]:
        """Read `launched`'s picks back and apply them; returns the requests with news
        to deliver. Under `step_lock`. A finishing request whose id() is in
        `keep_blocks` (it is in the step queued after this one, which writes to its
        blocks: async_steps.py) keeps its blocks and its id until that step is read
        back; its pick there is dropped."""
        result = launched.result()
        news = []
        for i, request in enumerate(launched.requests):
            if request.is_finished:        # a lookahead row of a request done a step ago
                self._let_go(request)
                continue
            request.append_token(result.token_ids[i])
            if result.logprobs is not None:
                request.logprobs.append(result.logprobs[i])
            if result.top_logprobs[i] is not None:
                request.top_logprobs.append(result.top_logprobs[i])
            news.append(request)
            if request.is_finished and id(request) not in keep_blocks:
                self._let_go(request)
        for entry, verdict in launched.verified:
            news.append(self._settle(entry, verdict))
        for entry, part in launched.pooled:
            request = entry.request
            request.pooled = add_part(request.pooled, part, request.pooling)
        for entry in launched.pooling_done:
            news.append(self._embedded(entry.request))
        return news

    def _embedded(self, request: RequestState) -> RequestState:
        """An embedding request whose whole prompt has run: its vector (or label
        logits), and done."""
        request.embedding = embedding_of(request.pooled, request.pooling,
                                         len(request.prompt_ids), self.runner.classify)
        request.pooled = None
        request.status, request.finish_reason = RequestStatus.FINISHED, "stop"
        self._let_go(request)
        return request

    def _settle(self, entry, verdict: Verdict) -> RequestState:
        """A verify entry's outcome: its accepted drafts and one token more appended
        (as a plain decode would have picked them, one by one, until one finishes the
        request), its computed positions and pages cut back past the rejected ones."""
        request = entry.request
        self.scheduler.proposer.accept(request, len(entry.drafts), verdict.accepted)
        for token in entry.drafts[:verdict.accepted] + (verdict.next_token,):
            request.append_token(token)
            if request.is_finished:
                break
        if request.is_finished:
            self._let_go(request)
        else:
            self.scheduler.settle_verify(request, entry.start + 1 + verdict.accepted)
        return request

    def _let_go(self, request: RequestState) -> None:
        self.scheduler.finish(request)
        self._forget(request.request_id)

    def deliver(self, requests: list[RequestState]) -> None:
        self.router.deliver_all([request.to_output() for request in requests
                                 if request.streaming or request.is_finished])

    def _fail_all(self, message: str) -> None:
        with self.step_lock:
            pending = self.scheduler.drain()
            while True:
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not _WAKE and item[0] == "add":
                    with self._count_lock:
                        self._num_submitted_unseen -= 1
                    pending.append(item[1])
        if self.async_steps is not None:
            self.async_steps.in_flight = None
        for request in pending:
            self._forget(request.request_id)
            if request.is_finished:        # done, its blocks kept for a lookahead row
                continue
            request.fail(message)
            self.router.deliver(request.to_output())


def _greedy_params():
    from ..generation_config import SamplingParams
    return SamplingParams()

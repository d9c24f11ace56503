"""Scheduler: picks which requests run in the next forward pass and how many tokens
each contributes. Pure Python (no torch).

One rule covers prefill, chunked prefill and decode: every scheduled request feeds the
model the tokens between its `num_computed_tokens` and its `num_tokens`, as many as the
step's token budget (`max_batch_tokens`) allows. A request whose chunk reaches its last
token gets a new token sampled.

Worked example, budget 16, page_size 4: a 40-token prompt runs as chunks 0..16,
16..32, 32..40 over three steps (blocks allocated 4, 4, then 2 more); the third step
samples its first token, and from then on it schedules 1 token per step.

Policies (SCHEDULER_MAPPING):
- fifo: running requests first (oldest first), then new ones while budget, blocks and
  the safety margin allow.
- prefill_first: requests still prefilling (running, then waiting) first, then decodes
  with what is left of the budget.

When a running request needs a block and none is free, the most recently admitted
running request is preempted: its K/V is copied to the CPU offload pool when there is
one with room (restored on re-admission, nothing recomputed), its blocks are freed,
and it goes back to the front of the waiting queue; without offload it is recomputed
from its tokens (its generated tokens are kept, so nothing is lost).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..kv_cache.allocator import BlockAllocator
from ..kv_cache.block_manager import BlockManager, blocks_needed
from ..outputs import RequestStatus
from .requests import RequestState
from ..speculative.proposer import Proposer


@dataclass(frozen=True)
class ScheduledRequest:
    request: RequestState
    start: int
    """First position fed this step (== request.num_computed_tokens before the step)."""
    num_tokens: int
    """How many tokens this request feeds the model this step."""
    samples: bool
    """True when this chunk reaches the request's last token, so a token is sampled."""
    drafts: tuple[int, ...] = ()
    """A verify step's proposed tokens (speculative/): fed after the request's last
    token, num_tokens = 1 + len(drafts), every row scored."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    entries: list[ScheduledRequest]
    """In batch order: the runner flattens their tokens in this order."""
    preempted: list[RequestState]
    """Requests that lost their blocks while this batch was built."""
    swap_out: list[tuple[list[int], list[int]]] = ()
    """(device blocks, pool slots) to copy to the CPU pool before the forward pass."""
    swap_in: list[tuple[list[int], list[int]]] = ()
    """(pool slots, device blocks) to copy back after the swap-outs."""
    prefix_copies: list[tuple[int, int, int]] = ()
    """(source block, target block, slots): partial-page prefixes, copied after the swaps."""

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, page_size: int, max_batch_tokens: int,
                 max_requests_per_batch: int, safety_margin: float, policy: str = "fifo",
                 offload_allocator: BlockAllocator | None = None,
                 sliding_allocator: BlockAllocator | None = None,
                 sliding_window: int | None = None, proposer: Proposer | None = None
                 ) -> None:
        """`proposer`: drafts for decoding requests (speculative decoding), or None."""
        if policy not in SCHEDULER_MAPPING:
            raise ValueError(f"unknown scheduler policy {policy!r}")
        self.allocator = allocator
        self.blocks = BlockManager(allocator, page_size, offload_allocator,
                                   sliding_allocator, sliding_window)
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = safety_margin
        self.policy = policy
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0
        self.proposer = proposer

    # -- queue management ------------------------------------------------------------
    def add(self, request: RequestState) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request_id: str) -> RequestState | None:
        """Drop a request wherever it is and free its blocks."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._drop(request)
                    return request
        return None

    def finish(self, request: RequestState) -> None:
        self.running.remove(request)
        self._drop(request)

    def _drop(self, request: RequestState) -> None:
        self.blocks.drop(request)
        if self.proposer is not None:
            self.proposer.release(request)

    def settle_verify(self, request: RequestState, computed: int) -> None:
        """After a verify step: `computed` of the request's positions hold K/V of its
        tokens; blocks past the next token's page (rejected drafts') are freed."""
        request.num_computed_tokens = computed
        self.blocks.trim(request, computed + 1)

    def drain(self) -> list[RequestState]:
        """Remove every request (hard stop); returns them."""
        requests = list(self.running) + list(self.waiting)
        for request in requests:
            self._drop(request)
        self.running.clear()
        self.waiting.clear()
        return requests

    def check_invariants(self) -> None:
        requests = list(self.running) + list(self.waiting)
        self.allocator.check_invariants([r.block_ids for r in requests]
                                        + [self.blocks.pinned_blocks])
        if self.blocks.offload_allocator is not None:
            self.blocks.offload_allocator.check_invariants(self.blocks.pool_holders(requests))
        if self.blocks.sliding_allocator is not None:
            self.blocks.sliding_allocator.check_invariants(
                [[b for b in r.sliding_block_ids if b is not None] for r in requests])

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch, or None when there is nothing to run."""
        self.blocks.begin_step()
        if self.proposer is not None:      # drafts of every decoding request, at once
            self.proposer.prepare([r for r in self.running
                                   if r.status is RequestStatus.DECODING], len(self.running))
        step = _StepBuilder(self)
        SCHEDULER_MAPPING[self.policy](step)
        if not step.entries and not (self.blocks.swap_out or self.blocks.swap_in):
            return None   # (copies recorded this step must still run: never dropped)
        return ScheduledBatch(entries=step.entries, preempted=step.preempted,
                              swap_out=self.blocks.swap_out, swap_in=self.blocks.swap_in,
                              prefix_copies=self.blocks.prefix_copies)

    def _preempt(self, request: RequestState) -> None:
        """Take the request's blocks away: its K/V goes to the CPU pool when there is
        room (resumed without recompute), else it will be recomputed from its tokens."""
        self.running.remove(request)
        self.blocks.offload(request)
        self.blocks.release(request)
        if not request.offloaded_slots:
            request.pooled = None      # an embedding request's rows will be fed again
        request.num_computed_tokens = 0
        request.status = RequestStatus.PENDING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


class _StepBuilder:
    """Accumulates one step's entries against the token budget."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.entries: list[ScheduledRequest] = []
        self.preempted: list[RequestState] = []
        self.budget = scheduler.max_batch_tokens
        self.scheduled_ids: set[str] = set()
        self.reserved = 0
        """Request slots and tokens held back for decodes scheduled later this step."""

    def _full(self) -> bool:
        return (self.budget - self.reserved <= 0
                or len(self.entries) + self.reserved >= self.scheduler.max_requests_per_batch)

    def _add(self, request: RequestState, num_tokens: int,
             drafts: tuple[int, ...] = ()) -> None:
        start = request.num_computed_tokens
        end = start + num_tokens           # (the drafts' positions hold no token yet:
        self.entries.append(ScheduledRequest(request, start, num_tokens + len(drafts),
                                             samples=end == request.num_tokens,
                                             drafts=drafts))
        self.scheduler.blocks.register_full_blocks(request, end)   # not offered to the cache)
        self.budget -= num_tokens + len(drafts)
        self.scheduled_ids.add(request.request_id)

    def _drafts(self, request: RequestState, remaining: int) -> tuple[int, ...]:
        """Drafts for a decoding request whose pages can take them without preempting
        anyone (else none)."""
        sched = self.scheduler
        if sched.proposer is None or remaining != 1 or request.status is not RequestStatus.DECODING:
            return ()
        drafts = sched.proposer.propose(request, self.budget - self.reserved - 1,
                                       len(sched.running))
        if drafts and not sched.blocks.grow(request, request.num_tokens + len(drafts)):
            return ()
        return drafts

    def schedule_running(self, prefills: bool | None) -> None:
        """Schedule running requests in admission order. `prefills` selects only those
        still prefilling (True), only decodes (False) or all (None)."""
        sched = self.scheduler
        for request in list(sched.running):
            if self._full():
                return
            if (request.request_id in self.scheduled_ids
                    or request.status is RequestStatus.PENDING):
                continue    # already in this batch, or preempted earlier in this loop
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 0:     # an embedding request's whole prompt ran: it ends when
                continue           # its last step is read back (engine_loop.collect)
            if prefills is not None and (remaining > 1) != prefills:
                continue
            num_tokens = min(remaining, self.budget - self.reserved)
            drafts = self._drafts(request, remaining)
            while not sched.blocks.grow(request, request.num_computed_tokens + num_tokens):
                victim = self._pick_victim(request)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self._add(request, num_tokens, drafts)

    def _pick_victim(self, request: RequestState) -> RequestState:
        """The most recently admitted running request not already in this batch;
        `request` itself when there is none."""
        for candidate in reversed(self.scheduler.running):
            if candidate is not request and candidate.request_id not in self.scheduled_ids:
                return candidate
        return request

    def _preempt(self, request: RequestState) -> None:
        self.scheduler._preempt(request)
        self.preempted.append(request)

    def admit_waiting(self) -> None:
        sched = self.scheduler
        while sched.waiting and not self._full():
            request = sched.waiting[0]
            num_tokens = self._admit(request)
            if num_tokens is None:
                return
            sched.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            request.status = RequestStatus.PREFILLING
            sched.running.append(request)
            self._add(request, num_tokens)

    def _admit(self, request: RequestState) -> int | None:
        """Give a waiting request its blocks (restored from the CPU pool, or a cached
        prefix plus new ones); returns how many tokens it runs now, None if it must wait."""
        sched, blocks = self.scheduler, self.scheduler.blocks
        if request.offloaded_slots:
            start = request.offloaded_tokens
            num_tokens = min(request.num_tokens - start, self.budget - self.reserved)
            if not self._room_for(blocks_needed(start + num_tokens, sched.page_size)):
                return None
            blocks.restore(request)
            blocks.grow(request, start + num_tokens)
            return num_tokens
        for use_retained in (True, False):
            partial = blocks.take_cached_prefix(request, sched.running, use_retained)
            start = request.num_computed_tokens
            num_tokens = min(request.num_tokens - start, self.budget - self.reserved)
            needed = blocks_needed(start + num_tokens, sched.page_size) - len(request.block_ids)
            if self._room_for(needed) and blocks.grow(request, start + num_tokens):
                if partial is not None:
                    blocks.copy_partial_prefix(request, partial)
                blocks.count_prefix_lookup(request)
                return num_tokens
            blocks.release(request)          # give the cached prefix back
            blocks.give_back(partial)
            request.num_computed_tokens = request.num_cached_tokens = 0
            if partial is None or not partial.retained:
                return None                  # (the retained page held a block: retry)
        return None

    def _room_for(self, num_blocks: int) -> bool:
        """Enough free blocks, keeping `safety_margin` of the cache free while other
        requests run (with nothing running, a request is always let in)."""
        allocator = self.scheduler.allocator
        if not allocator.can_allocate(num_blocks):
            return False
        if not self.scheduler.running:
            return True
        margin_blocks = self.scheduler.safety_margin * allocator.num_blocks
        return allocator.num_free_blocks - num_blocks >= margin_blocks


def _fifo(step: _StepBuilder) -> None:
    step.schedule_running(prefills=None)
    step.admit_waiting()


def _prefill_first(step: _StepBuilder) -> None:
    # Prefills go first, but one slot and one token per decoding request are held
    # back, so a stream of arrivals can never starve the requests already decoding.
    step.reserved = sum(1 for r in step.scheduler.running
                        if r.num_tokens - r.num_computed_tokens == 1)
    step.schedule_running(prefills=True)
    step.admit_waiting()
    step.reserved = 0
    step.schedule_running(prefills=False)


SCHEDULER_MAPPING = {"fifo": _fifo, "prefill_first": _prefill_first}

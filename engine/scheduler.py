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
running request is preempted: its blocks are freed, its progress reset, and it goes
back to the front of the waiting queue to be recomputed later (its generated tokens
are kept, so nothing is lost).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache.allocator import BlockAllocator
from .kv_cache.block_hash import extend_block_hashes
from .outputs import RequestStatus
from .requests import RequestState


@dataclass(frozen=True)
class ScheduledRequest:
    request: RequestState
    start: int
    """First position fed this step (== request.num_computed_tokens before the step)."""
    num_tokens: int
    """How many tokens this request feeds the model this step."""
    samples: bool
    """True when this chunk reaches the request's last token, so a token is sampled."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    entries: list[ScheduledRequest]
    """In batch order: the runner flattens their tokens in this order."""
    preempted: list[RequestState]
    """Requests that lost their blocks while this batch was built."""

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


def blocks_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, page_size: int, max_batch_tokens: int,
                 max_requests_per_batch: int, safety_margin: float, policy: str = "fifo") -> None:
        if policy not in SCHEDULER_MAPPING:
            raise ValueError(f"unknown scheduler policy {policy!r}")
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = safety_margin
        self.policy = policy
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        """Prompt tokens looked up in the prefix cache at admission."""
        self.prefix_hit_tokens = 0
        """Of those, tokens found cached (not recomputed)."""

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
                    self._release(request)
                    return request
        return None

    def finish(self, request: RequestState) -> None:
        self.running.remove(request)
        self._release(request)

    def drain(self) -> list[RequestState]:
        """Remove every request (hard stop); returns them."""
        requests = list(self.running) + list(self.waiting)
        for request in requests:
            self._release(request)
        self.running.clear()
        self.waiting.clear()
        return requests

    def _release(self, request: RequestState) -> None:
        self.allocator.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0

    def _take_cached_prefix(self, request: RequestState) -> None:
        """On admission, reuse every cached full block of the request's tokens, but
        always leave at least one token to compute (its logits give the next token)."""
        if not self.allocator.enable_caching:
            return
        tokens = request.all_tokens()
        extend_block_hashes(request.block_hashes, tokens, self.page_size)
        usable = (len(tokens) - 1) // self.page_size
        cached = self.allocator.lookup(request.block_hashes[:usable])
        self.prefix_queried_tokens += len(tokens)
        self.prefix_hit_tokens += len(cached) * self.page_size
        self.allocator.share(cached)
        request.block_ids = cached
        request.num_registered_blocks = len(cached)
        request.num_computed_tokens = request.num_cached_tokens = len(cached) * self.page_size

    def _register_full_blocks(self, request: RequestState, end: int) -> None:
        """Offer the blocks that `end` tokens fill to the prefix cache. Done at
        scheduling time: within a forward pass every layer writes the step's K/V
        before attending, so a request admitted later in the same step may already
        read them."""
        if not self.allocator.enable_caching:
            return
        num_full = end // self.page_size
        if num_full <= request.num_registered_blocks:
            return
        extend_block_hashes(request.block_hashes, request.tokens_between(0, num_full * self.page_size),
                            self.page_size)
        for index in range(request.num_registered_blocks, num_full):
            self.allocator.register(request.block_ids[index], request.block_hashes[index])
        request.num_registered_blocks = num_full

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Build the next batch, or None when there is nothing to run."""
        step = _StepBuilder(self)
        SCHEDULER_MAPPING[self.policy](step)
        if not step.entries:
            return None
        return ScheduledBatch(entries=step.entries, preempted=step.preempted)

    def _grow(self, request: RequestState, new_end: int) -> bool:
        """Give `request` enough blocks to hold `new_end` tokens."""
        missing = blocks_needed(new_end, self.page_size) - len(request.block_ids)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing):
            return False
        request.block_ids.extend(self.allocator.allocate(missing))
        return True

    def _preempt(self, request: RequestState) -> None:
        self.running.remove(request)
        self._release(request)
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

    def _full(self) -> bool:
        return self.budget <= 0 or len(self.entries) >= self.scheduler.max_requests_per_batch

    def _add(self, request: RequestState, num_tokens: int) -> None:
        start = request.num_computed_tokens
        self.entries.append(ScheduledRequest(request, start, num_tokens,
                                             samples=start + num_tokens == request.num_tokens))
        self.scheduler._register_full_blocks(request, start + num_tokens)
        self.budget -= num_tokens
        self.scheduled_ids.add(request.request_id)

    def schedule_running(self, prefills: bool | None) -> None:
        """Schedule running requests in admission order. `prefills` selects only those
        still prefilling (True), only decodes (False) or all (None)."""
        sched = self.scheduler
        for request in list(sched.running):
            if self._full():
                return
            if request.request_id in self.scheduled_ids or request not in sched.running:
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            if prefills is not None and (remaining > 1) != prefills:
                continue
            num_tokens = min(remaining, self.budget)
            while not sched._grow(request, request.num_computed_tokens + num_tokens):
                victim = self._pick_victim(request)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self._add(request, num_tokens)

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
        allocator = sched.allocator
        while sched.waiting and not self._full():
            request = sched.waiting[0]
            sched._take_cached_prefix(request)
            start = request.num_computed_tokens
            num_tokens = min(request.num_tokens - start, self.budget)
            needed = blocks_needed(start + num_tokens, sched.page_size) - len(request.block_ids)
            margin_blocks = sched.safety_margin * allocator.num_blocks
            if (sched.running and allocator.num_free_blocks - needed < margin_blocks) \
                    or not sched._grow(request, start + num_tokens):
                sched._release(request)          # give the cached prefix back
                request.num_computed_tokens = 0
                return
            sched.waiting.popleft()
            request.status = RequestStatus.PREFILLING
            sched.running.append(request)
            self._add(request, num_tokens)


def _fifo(step: _StepBuilder) -> None:
    step.schedule_running(prefills=None)
    step.admit_waiting()


def _prefill_first(step: _StepBuilder) -> None:
    step.schedule_running(prefills=True)
    step.admit_waiting()
    step.schedule_running(prefills=False)


SCHEDULER_MAPPING = {"fifo": _fifo, "prefill_first": _prefill_first}

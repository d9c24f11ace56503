"""BlockManager: the per-request side of the KV cache. Pure Python (no torch).

It turns scheduler decisions into block operations on the allocator:
- `grow`: give a request the blocks its next tokens need;
- prefix caching: `take_cached_prefix` on admission, `register_full_blocks` as blocks fill;
  below a page, the start of the first uncached page copied from a running request
  (partial_prefix.py): `prefix_copies`, run by the runner after the swaps;
- KV events (kv_events.py): while they are published, each run of blocks newly
  indexed by `register_full_blocks` is one BlockStored (the allocator records evictions);
- sliding windows (hybrid models): sliding layers have their own block pool; a request
  holds `sliding_block_ids` only for the pages its window still covers, and `grow`
  recycles the pages that fell out of the window (their entry becomes None);
- CPU offload: `offload` copies a preempted request's computed blocks to a CPU pool
  (a second allocator over the pool's slots) and `restore` brings them back, so the
  request resumes without recomputing anything. The copies themselves are done by the
  runner before the step's forward pass, swap-outs before swap-ins; pool slots read by
  a swap-in are only freed at the next step so no swap-out of the same step reuses them.
"""

from __future__ import annotations

from .allocator import BlockAllocator
from .block_hash import extend_block_hashes
from .partial_prefix import PartialPrefix, RetainedPage, RetainedPages, find_partial_prefix
from ..core.requests import RequestState


def blocks_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockManager:
    def __init__(self, allocator: BlockAllocator, page_size: int,
                 offload_allocator: BlockAllocator | None = None,
                 sliding_allocator: BlockAllocator | None = None,
                 sliding_window: int | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.offload_allocator = offload_allocator
        self.sliding_allocator = sliding_allocator
        self.sliding_window = sliding_window if sliding_allocator is not None else None
        self.swap_out: list[tuple[list[int], list[int]]] = []   # (device blocks, pool slots)
        self.swap_in: list[tuple[list[int], list[int]]] = []    # (pool slots, device blocks)
        self._pool_slots_to_free: list[int] = []
        self.prefix_copies: list[tuple[int, int, int]] = []
        """(source block, target block, slots) of this step's partial-page prefixes."""
        self.pinned_blocks: list[int] = []
        """Source blocks of `prefix_copies`, held until the next step begins."""
        self.written_this_step: dict[int, int] = {}
        """Blocks offered to the prefix cache while this step is built whose K/V this
        step's forward pass writes, each with the first slot it writes: the slots
        before it hold their K/V already (earlier steps, or this step's copies), the
        rest only once the forward pass has run. A request admitted in the same step
        may read such a block in the forward pass (register_full_blocks), but a copy,
        which runs before it, must not (`ready_slots`)."""
        self.retained_pages = RetainedPages()
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def grow(self, request: RequestState, end: int) -> bool:
        """Give `request` enough blocks to hold `end` tokens; False if none are left."""
        needed = blocks_needed(end, self.page_size)
        missing = needed - len(request.block_ids)
        missing_sliding = 0
        if self.sliding_allocator is not None:
            self._recycle_out_of_window(request)
            missing_sliding = needed - len(request.sliding_block_ids)
            if not self.sliding_allocator.can_allocate(missing_sliding):
                return False
        if not self.allocator.can_allocate(missing):
            return False
        if missing > 0:
            request.block_ids.extend(self.allocator.allocate(missing))
        if missing_sliding > 0:
            request.sliding_block_ids.extend(self.sliding_allocator.allocate(missing_sliding))
        return True

    def trim(self, request: RequestState, end: int) -> None:
        """Free the request's blocks past what `end` tokens need (a verify step's
        rejected drafts' pages, never offered to the prefix cache), tail first."""
        keep = max(blocks_needed(end, self.page_size), request.num_registered_blocks)
        if len(request.block_ids) > keep:
            self.allocator.free(reversed(request.block_ids[keep:]))
            del request.block_ids[keep:]

    def _recycle_out_of_window(self, request: RequestState) -> None:
        """Free the sliding pages no future query can see: the next query sits at
        `num_computed_tokens` and sees keys after num_computed_tokens - window."""
        first_key = max(0, request.num_computed_tokens - self.sliding_window + 1)
        blocks = request.sliding_block_ids
        for index in range(min(first_key // self.page_size, len(blocks))):
            if blocks[index] is not None:
                self.sliding_allocator.free([blocks[index]])
                blocks[index] = None

    def release(self, request: RequestState) -> None:
        """Free the request's device blocks (tail first, so a cached prefix's end is
        evicted before its start)."""
        self.allocator.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0
        if request.sliding_block_ids:
            self.sliding_allocator.free(b for b in request.sliding_block_ids if b is not None)
            request.sliding_block_ids = []

    def drop(self, request: RequestState) -> None:
        """The request is gone: free its device blocks and any offloaded copy. Its
        partial page is remembered while its block stays untouched (partial_prefix.py)."""
        self._retain_partial_page(request)
        self.release(request)
        if request.offloaded_slots:
            self.offload_allocator.free(request.offloaded_slots)
            request.offloaded_slots, request.offloaded_tokens = [], 0

    # -- prefix caching --------------------------------------------------------------
    def take_cached_prefix(self, request: RequestState, running: list[RequestState] = (),
                           use_retained: bool = True) -> PartialPrefix | None:
        """On admission, reuse every cached full block of the request's tokens, but
        always leave at least one token to compute (its logits give the next token).
        Then the start of the next page (partial_prefix.py): the request's own last page
        when its tokens fill their pages exactly and that page is cached whole, else
        the longest one in `running` (and, with `use_retained`, among the pages of
        ended requests); its tokens count as computed too; the caller passes the returned PartialPrefix to
        `copy_partial_prefix` once the request has its blocks, or to `give_back` when
        it does not get them."""
        if not self.allocator.enable_caching or (request.pooling is not None
                                                 and request.pooling.kind != "last"):
            return None    # mean and first-token pooling read every prompt row's state
        tokens = request.all_tokens()
        extend_block_hashes(request.block_hashes, tokens, self.page_size)
        usable = (len(tokens) - 1) // self.page_size
        cached = self.allocator.lookup(request.block_hashes[:usable])
        self.allocator.share(cached)
        request.block_ids = cached
        request.num_registered_blocks = len(cached)
        request.num_computed_tokens = request.num_cached_tokens = len(cached) * self.page_size
        if self.sliding_allocator is not None:   # (its pages would need copies too)
            return None
        partial = (self._last_full_page(request, len(cached))
                   or self._shared_page_start(request, running, use_retained, cached))
        if partial is not None:
            request.num_computed_tokens += partial.num_tokens
            request.num_cached_tokens = request.num_computed_tokens
        return partial

    def _shared_page_start(self, request: RequestState, running: list[RequestState],
                           use_retained: bool, cached: list[int]) -> PartialPrefix | None:
        """The longest start of the request's next page that a running request, or
        (with `use_retained`) an ended one's retained page, already holds."""
        partial = find_partial_prefix(request, running, self.page_size, self.ready_slots)
        retained = None if not use_retained else self.retained_pages.find(
            request, request.block_hashes[len(cached) - 1] if cached else None,
            self.allocator, self.page_size)
        if retained is not None and retained.num_tokens > (partial.num_tokens if partial else 0):
            self.allocator.take_free(retained.source_block)      # held until the next step
            self.pinned_blocks.append(retained.source_block)
            partial = retained
        return partial

    def _last_full_page(self, request: RequestState, page: int) -> PartialPrefix | None:
        """A request whose tokens fill its pages exactly, all of them cached, gets every
        page but the last from the cache (one token must be computed); that last page's
        first page_size - 1 slots are copied from its cached block instead of computed.
        The block is held from here until the copy (an unheld cached block could
        otherwise be evicted by the request's own allocation first)."""
        if (page >= len(request.block_hashes)
                or request.num_tokens != (page + 1) * self.page_size):
            return None
        found = self.allocator.lookup(request.block_hashes[page:page + 1])
        if not found or self.ready_slots(found[0]) < self.page_size - 1:
            return None                  # (cached this step: written by its forward pass)
        self.allocator.share(found)
        self.pinned_blocks.append(found[0])
        return PartialPrefix(found[0], self.page_size - 1, retained=True)

    def copy_partial_prefix(self, request: RequestState, partial: PartialPrefix) -> None:
        """The admitted request's page gets the shared slots before the next forward
        pass; the source block stays held until then."""
        target = request.block_ids[(request.num_computed_tokens - 1) // self.page_size]
        source = partial.source_block
        for earlier_source, earlier_target, _ in self.prefix_copies:
            if earlier_target == source:   # a source admitted this step, its slots
                source = earlier_source    # still to be copied: read where they come from
                break                      # (pinned already; never a target itself)
        else:
            if not partial.retained:       # (a retained page was taken when found)
                self.allocator.share([source])
                self.pinned_blocks.append(source)
        self.prefix_copies.append((source, target, partial.num_tokens))

    def ready_slots(self, block: int) -> int:
        """How many leading slots of `block` hold their K/V before this step's forward
        pass, so that a copy may read them: all of them, but for a block cached
        this step (`written_this_step`)."""
        return self.written_this_step.get(block, self.page_size)

    def give_back(self, partial: PartialPrefix | None) -> None:
        """The request was not admitted: a retained page taken for it is free again."""
        if partial is not None and partial.retained:
            self.pinned_blocks.remove(partial.source_block)
            self.allocator.free([partial.source_block])

    def _retain_partial_page(self, request: RequestState) -> None:
        computed, size = request.num_computed_tokens, self.page_size
        page = computed // size
        if (not self.allocator.enable_caching or self.sliding_allocator is not None
                or computed % size == 0 or page >= len(request.block_ids)):
            return
        extend_block_hashes(request.block_hashes, request.tokens_between(0, page * size), size)
        block = request.block_ids[page]
        self.retained_pages.add(RetainedPage(
            block, request.block_hashes[page - 1] if page else None,
            request.tokens_between(page * size, computed), self.allocator.times_allocated(block)))

    def count_prefix_lookup(self, request: RequestState) -> None:
        """Once a request is admitted: its tokens were looked up, `num_cached_tokens`
        of them found (a request that waits and retries is counted once)."""
        if self.allocator.enable_caching:
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += request.num_cached_tokens

    def register_full_blocks(self, request: RequestState, end: int) -> None:
        """Offer the blocks that `end` tokens fill to the prefix cache. Done at
        scheduling time: within a forward pass every layer writes the step's K/V
        before attending, so a request admitted later in the same step may already
        read them in that forward pass. Not in a copy before it, though: the slots
        from `request.num_computed_tokens` on (the step's first position) are noted
        in `written_this_step`. (Registered after the step was launched, as
        async_steps.py does, num_computed_tokens is already `end`: nothing noted.)"""
        num_full = end // self.page_size
        if not self.allocator.enable_caching or num_full <= request.num_registered_blocks:
            return
        extend_block_hashes(request.block_hashes,
                            request.tokens_between(0, num_full * self.page_size), self.page_size)
        run_start = None       # first of the blocks newly indexed in a row, if any
        for index in range(request.num_registered_blocks, num_full):
            block = request.block_ids[index]
            if self.allocator.register(block, request.block_hashes[index]):
                run_start = index if run_start is None else run_start
            elif run_start is not None:   # (another request indexed this hash first)
                self._announce_stored(request, run_start, index)
                run_start = None
            first_written = max(0, request.num_computed_tokens - index * self.page_size)
            if first_written < self.page_size:
                self.written_this_step[block] = min(
                    first_written, self.written_this_step.get(block, self.page_size))
        if run_start is not None:
            self._announce_stored(request, run_start, num_full)
        request.num_registered_blocks = num_full

    def _announce_stored(self, request: RequestState, start: int, end: int) -> None:
        """Blocks start..end-1 of `request` were newly indexed: one BlockStored event
        while KV events are published (kv_events.py)."""
        events = self.allocator.events
        if events is None:
            return
        size = self.page_size
        events.stored(request.block_hashes[start:end],
                      request.block_hashes[start - 1] if start else None,
                      request.tokens_between(start * size, end * size), size)

    # -- CPU offload -----------------------------------------------------------------
    def offload(self, request: RequestState) -> bool:
        """Preemption: copy the computed blocks to the pool if it has room."""
        pool = self.offload_allocator
        count = blocks_needed(request.num_computed_tokens, self.page_size)
        if pool is None or count == 0 or not pool.can_allocate(count):
            return False
        slots = pool.allocate(count)
        self.swap_out.append((request.block_ids[:count], slots))
        request.offloaded_slots, request.offloaded_tokens = slots, request.num_computed_tokens
        self.num_swapped_out += 1
        return True

    def restore(self, request: RequestState) -> bool:
        """Admission of an offloaded request: new device blocks, copied back from the pool."""
        slots = request.offloaded_slots
        if not self.allocator.can_allocate(len(slots)):
            return False
        request.block_ids = self.allocator.allocate(len(slots))
        self.swap_in.append((slots, list(request.block_ids)))
        self._pool_slots_to_free.extend(slots)
        request.num_computed_tokens = request.offloaded_tokens
        request.offloaded_slots, request.offloaded_tokens = [], 0
        self.num_swapped_in += 1
        return True

    def begin_step(self) -> None:
        """Pool slots read by the previous step's swap-ins, and source blocks of its
        prefix copies, are free again."""
        if self._pool_slots_to_free:
            self.offload_allocator.free(self._pool_slots_to_free)
            self._pool_slots_to_free = []
        if self.pinned_blocks:
            self.allocator.free(self.pinned_blocks)
            self.pinned_blocks = []
        self.swap_out, self.swap_in, self.prefix_copies = [], [], []
        self.written_this_step = {}

    def pool_holders(self, requests) -> list[list[int]]:
        return [r.offloaded_slots for r in requests] + [self._pool_slots_to_free]

"""Prefix sharing below a page: copying the start of a page from a running request.

The prefix cache (allocator.py, block_hash.py) shares whole pages only. With 256-token
pages a chat template's system prompt (~30 tokens) never fills one, so every chat
recomputes it. Here a request being admitted may start its first uncached page with
K/V that another running request has already computed for the same tokens at the same
positions: those tokens count as computed, and their slots are copied from the other
request's page into the new request's own page, in every layer, before the forward
pass (`copy_slots` in paged_cache.py). Pure Python (no torch).

Worked example, page_size 256: chat A is running with 98 tokens computed in block 7;
chat B (100 tokens) is admitted with no cached full page and gets block 3. Their
tokens agree on positions 0..30 (system prompt and "<|im_start|>user\\n"), so B's
shared prefix is PartialPrefix(source_block=7, num_tokens=31): slots 7*256 + 0..30 are
copied to 3*256 + 0..30 and B computes positions 31..99 only.

A source's `num_computed_tokens` counts its slots once they are scheduled: computed
by earlier steps, copied in this step's copies when the source was itself admitted
in this step, or full pages it found cached that another request registered while
this step was built. The copies of one step are read before any is written, so a
copy from a source admitted this step reads the block its own copy comes from
instead (BlockManager.copy_partial_prefix). The copies also run before the forward
pass, so slots that this step's forward pass writes (of a page cached this step:
BlockManager.written_this_step) are never copied; the new request computes them.
The source block is pinned by the block manager until the next step has copied it,
so neither a preemption nor a finished source can hand the block to someone else
first.

The source may also be a request that has ended (`RetainedPages`): its partial page
goes back to the free list with its contents, and stays a source for as long as
nobody has been given that block since (the allocator counts how often it handed each
block out). A chat that follows another with the same system prompt, or the next turn
of a short conversation, then starts from the previous request's page.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from ..core.requests import RequestState


@dataclass(frozen=True)
class PartialPrefix:
    source_block: int
    """The block whose first `num_tokens` slots are copied."""
    num_tokens: int
    retained: bool = False
    """The block manager took (holds) the block when it was found: a freed block of
    RetainedPages, or the request's own last page cached whole
    (BlockManager._last_full_page); not a running request's."""


@dataclass(frozen=True)
class RetainedPage:
    block_id: int
    parent: bytes | None
    """Hash of the full blocks before the page (block_hash.py); None for a first page."""
    tokens: list[int]
    """The tokens whose K/V the page's first slots hold."""
    times_allocated: int
    """The allocator's count for the block when its request ended."""


class RetainedPages:
    """The partial pages of requests that ended, at most `capacity` (oldest dropped).
    Pure bookkeeping: the blocks stay on the allocator's free list."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, RetainedPage] = OrderedDict()

    def add(self, page: RetainedPage) -> None:
        self.pages.pop(page.block_id, None)
        self.pages[page.block_id] = page
        if len(self.pages) > self.capacity:
            self.pages.popitem(last=False)

    def find(self, request: RequestState, parent: bytes | None, allocator,
             page_size: int) -> PartialPrefix | None:
        """The page sharing the most tokens with `request`'s next page (it starts at
        `request.num_computed_tokens`, after full blocks hashed `parent`), among those
        whose blocks are still free and untouched; pages that are not are forgotten."""
        start = request.num_computed_tokens
        limit = min(page_size, request.num_tokens - 1 - start)
        if limit <= 0 or start % page_size:
            return None
        tokens = request.tokens_between(start, start + limit)
        best: PartialPrefix | None = None
        for page in list(self.pages.values()):
            if allocator.times_allocated(page.block_id) != page.times_allocated:
                del self.pages[page.block_id]       # given out since: overwritten
                continue
            if (not allocator.is_free(page.block_id)    # (taken for a copy this step)
                    or page.parent != parent or page.tokens[0] != tokens[0]):
                continue
            shared = _common_length(tokens, page.tokens, min(limit, len(page.tokens)))
            if shared > (best.num_tokens if best else 0):
                best = PartialPrefix(page.block_id, shared, retained=True)
        return best


def _common_length(tokens: list[int], other: list[int], limit: int) -> int:
    """How many leading positions (at most `limit`) hold equal tokens in both."""
    low, high = 0, limit                    # tokens agree on low positions, not past high
    while low < high:
        middle = (low + high + 1) // 2
        if other[:middle] == tokens[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def find_partial_prefix(request: RequestState, sources: Iterable[RequestState],
                        page_size: int,
                        ready_slots: Callable[[int], int] | None = None
                        ) -> PartialPrefix | None:
    """The longest run of already computed tokens that a request in `sources` shares
    with `request` in the page where `request`'s computed tokens end (a page boundary,
    right after its cached full blocks). At least one token is always left to compute,
    whose logits give the next token. None when no source shares a token.
    `ready_slots(block)`: how many leading slots of a source's block hold their K/V
    before this step's forward pass (BlockManager.ready_slots); a source's computed
    tokens may be a cached page that this step's forward pass is still to write."""
    start = request.num_computed_tokens
    page = start // page_size
    if start % page_size:
        return None
    limit = min(page_size, request.num_tokens - 1 - start)
    if limit <= 0:
        return None
    parent = request.block_hashes[page - 1] if page else None
    tokens = request.tokens_between(start, start + limit)
    best: PartialPrefix | None = None
    for source in sources:
        computed = min(source.num_computed_tokens - start, limit)
        if computed > 0 and ready_slots is not None:
            computed = min(computed, ready_slots(source.block_ids[page]))
        if (source is request or computed <= (best.num_tokens if best else 0)
                or source.tokens_between(start, start + 1)[0] != tokens[0]):
            continue
        # the positions before the page agree when the full blocks' hashes do (both
        # requests have them: their full blocks are computed, so registered)
        if page and (len(source.block_hashes) < page or source.block_hashes[page - 1] != parent):
            continue
        shared = _common_length(tokens, source.tokens_between(start, start + computed),
                                computed)
        if shared > (best.num_tokens if best else 0):
            best = PartialPrefix(source.block_ids[page], shared)
    return best

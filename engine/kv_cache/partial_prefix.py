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

Only slots computed by earlier steps are copied (a source's `num_computed_tokens`
moves after its step ran), and the source block is pinned by the block manager until
the next step has copied it, so neither a preemption nor a finished source can hand
the block to someone else first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..requests import RequestState


@dataclass(frozen=True)
class PartialPrefix:
    source_block: int
    """The running request's block whose first `num_tokens` slots are copied."""
    num_tokens: int


def _common_length(tokens: list[int], other: list[int], start: int, limit: int) -> int:
    """How many positions from `start` on (at most `limit`) hold equal tokens in both,
    given that positions before `start` must agree too (0 if they do not)."""
    if other[:start] != tokens[:start]:
        return 0
    low, high = 0, limit                    # tokens agree on low positions, not past high
    while low < high:
        middle = (low + high + 1) // 2
        if other[start:start + middle] == tokens[start:start + middle]:
            low = middle
        else:
            high = middle - 1
    return low


def find_partial_prefix(request: RequestState, sources: Iterable[RequestState],
                        page_size: int) -> PartialPrefix | None:
    """The longest run of already computed tokens that a request in `sources` shares
    with `request` in the page where `request`'s computed tokens end (a page boundary,
    right after its cached full blocks). At least one token is always left to compute,
    whose logits give the next token. None when no source shares a token."""
    start = request.num_computed_tokens
    page = start // page_size
    if start % page_size:
        return None
    limit = min(page_size, request.num_tokens - 1 - start)
    if limit <= 0:
        return None
    first_token = request.tokens_between(start, start + 1)[0]
    tokens: list[int] | None = None
    best: PartialPrefix | None = None
    for source in sources:
        computed = min(source.num_computed_tokens - start, limit)
        if (source is request or computed <= (best.num_tokens if best else 0)
                or source.tokens_between(start, start + 1)[0] != first_token):
            continue
        if tokens is None:
            tokens = request.tokens_between(0, start + limit)
        shared = _common_length(tokens, source.tokens_between(0, start + computed),
                                start, computed)
        if shared > (best.num_tokens if best else 0):
            best = PartialPrefix(source.block_ids[page], shared)
    return best

"""Draft-model speculation ("draft_model"): a small model with the target's vocabulary
proposes each request's next tokens greedily, run by the engine's own ModelRunner
over a paged KV cache of its own.

Per request the draft keeps a shadow RequestState: its tokens are the target
request's (prompt and accepted output) followed by the drafts it proposed last, and
its num_computed_tokens counts the leading positions whose K/V in the draft's cache
belong to those tokens. Before each step is built (`prepare`, on the engine thread,
from the scheduler) every decoding request that may take drafts gets them, all the
requests' draft steps batched together:

1. sync: the shadow takes the request's tokens; the positions still valid are those
   both sequences share (accepted drafts stay valid, rejected ones do not);
2. catch up: one step feeds the positions past them (a few tokens after a verify
   step, the whole prompt the first time) and picks the first draft;
3. extend: limit - 1 more one-token steps, each feeding the previous draft.

Worked example, limit 3: the target holds [a b c], the draft proposed [d e f] last
time and the target kept d, then picked x. The shadow held K/V of a b c d e; the
request now reads [a b c d x], so a b c d stay valid, one step feeds x (position 4)
and picks y, then y and z are fed one at a time: drafts [y z w].

Greedy picks are a point mass, so sampled requests keep their distribution through
the verify step's rejection sampling as with any deterministic proposer. A step of
the draft feeds every request still short of its allowance (the catch-up step the
tokens each needs, the later ones one token each). The draft's cache holds as many
tokens as the target's, at most a quarter of the target cache's bytes; a request
whose pages cannot be had gets no drafts that step.
"""

from __future__ import annotations

import logging

from ..generation_config import SamplingParams
from ..kv_cache.allocator import BlockAllocator
from ..kv_cache.sizing import CacheSizing
from ..core.requests import RequestState
from ..step.runner import ModelRunner
from ..core.scheduler import ScheduledBatch, ScheduledRequest, blocks_needed
from .config import SpeculativeConfig
from .proposer import NgramProposer

logger = logging.getLogger(__name__)

CACHE_SHARE = 0.25
"""The draft cache's bytes, at most, as a share of the target cache's."""


class DraftModelProposer(NgramProposer):
    def __init__(self, config: SpeculativeConfig, draft, target_sizing: CacheSizing) -> None:
        super().__init__(config)
        self.draft = draft
        spec = draft.module.engine_spec()
        per_block = (2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
                     * target_sizing.page_size * spec.kv_dtype(draft.device, draft.dtype).itemsize)
        budget = CACHE_SHARE * target_sizing.num_blocks * target_sizing.block_bytes
        num_blocks = max(1, min(target_sizing.num_blocks, int(budget // per_block)))
        sizing = CacheSizing(num_blocks, target_sizing.page_size, target_sizing.max_batch_tokens,
                             target_sizing.max_requests_per_batch, per_block)
        self.runner = ModelRunner(draft.module, sizing, seed=0)
        self.allocator = BlockAllocator(num_blocks)
        self.page_size = sizing.page_size
        self.shadows: dict[str, RequestState] = {}
        self.prepared: dict[str, list[int]] = {}
        self.num_steps = 0
        """Forward passes of the draft so far."""
        """request id -> drafts `prepare` made for the step being built."""
        logger.info("draft model: %d cache blocks of %d tokens", num_blocks, self.page_size)

    def prepare(self, requests: list[RequestState], batch_size: int) -> None:
        wanted = [(request, limit) for request in requests
                  if (limit := self.limit(request, batch_size)) > 0]
        self.prepared = self._draft_together(wanted) if wanted else {}

    def _propose(self, request: RequestState, limit: int) -> list[int]:
        drafts = self.prepared.pop(request.request_id, None)
        if drafts is None:              # not prepared this step: drafted alone
            drafts = self._draft_together([(request, limit)]).get(request.request_id, [])
        return drafts[:limit]

    def _draft_together(self, wanted: list[tuple[RequestState, int]]) -> dict[str, list[int]]:
        """request id -> its drafts, up to its limit, the requests' draft steps
        batched: the first feeds each shadow's positions past its valid ones (at least
        its last token, for the logits), each later one the previous drafts."""
        active = []               # (request id, shadow, limit, start, end)
        for request, limit in wanted:
            shadow = self._sync(request)
            if self._pages_for(shadow, request.num_tokens + limit):
                end = request.num_tokens
                active.append((request.request_id, shadow, limit,
                               min(shadow.num_computed_tokens, end - 1), end))
        drafts: dict[str, list[int]] = {rid: [] for rid, *_ in active}
        while active:
            batch = ScheduledBatch([ScheduledRequest(shadow, start, end - start, True)
                                    for _, shadow, _, start, end in active], [])
            _, result = self.runner.step(batch)
            self.num_steps += 1
            still = []
            for (rid, shadow, limit, _, end), token in zip(active, result.token_ids):
                drafts[rid].append(token)
                shadow.generated_tokens.append(token)
                shadow.num_computed_tokens = end
                if len(drafts[rid]) < limit:
                    still.append((rid, shadow, limit, end, end + 1))
            active = still
        return drafts

    def _sync(self, request: RequestState) -> RequestState:
        """The request's shadow holding its tokens, valid positions counted. The
        shadow's prompt_ids are the request's tokens at the last sync, which never
        change: only its drafts are compared with the tokens the request gained since,
        so a step costs the new tokens, not the context."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = self.shadows[request.request_id] = RequestState(
                f"draft-{request.request_id}", request.all_tokens(), request.max_new_tokens,
                (), SamplingParams())
            return shadow
        real = len(shadow.prompt_ids)
        new = request.tokens_between(real, request.num_tokens)
        valid = min(shadow.num_computed_tokens, real)
        if valid == real:           # its fed drafts hold K/V as far as the request kept them
            drafts, fed = shadow.generated_tokens, shadow.num_computed_tokens - real
            while valid - real < min(fed, len(new)) and drafts[valid - real] == new[valid - real]:
                valid += 1
        shadow.prompt_ids.extend(new)
        shadow.generated_tokens = []
        shadow.num_computed_tokens = valid
        return shadow

    def _pages_for(self, shadow: RequestState, num_tokens: int) -> bool:
        """Pages for `num_tokens` positions of the shadow (False: none to be had)."""
        missing = blocks_needed(num_tokens, self.page_size) - len(shadow.block_ids)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing):
            return False
        shadow.block_ids.extend(self.allocator.allocate(missing))
        return True

    def release(self, request: RequestState) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None and shadow.block_ids:
            self.allocator.free(shadow.block_ids)
        super().release(request)


def load_draft_proposer(config: SpeculativeConfig, target, target_sizing: CacheSizing
                        ) -> DraftModelProposer:
    """Load `config.model` beside `target` (same device, its dtype's mode) and check
    it proposes in the target's vocabulary; ValueError naming the setting if not."""
    draft = target.load_beside(config.model)
    if draft.module.engine_spec().pooled_sliding:
        raise ValueError(f"speculative_config.model: {config.model} has sliding-window "
                         f"layers, which draft models do not support yet")
    same = (int(draft.config.vocab_size) == int(target.config.vocab_size)
            if draft.tokenizer is None or target.tokenizer is None
            else draft.tokenizer.get_vocab() == target.tokenizer.get_vocab())
    if not same:
        raise ValueError(f"speculative_config.model: {config.model} does not share the "
                         f"served model's vocabulary (its tokens would mean other text)")
    return DraftModelProposer(config, draft, target_sizing)

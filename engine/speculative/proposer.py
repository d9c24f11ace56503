"""The scheduler's source of drafts: which decoding requests speculate this step and
with which tokens. Plain Python (the scheduler imports no torch).

A request speculates when the verify step can judge its drafts from the logits it
scores alone: greedy picks (exactly the tokens plain decoding gives) or sampling with
temperature, top-k, top-p and min-p (rejection sampling keeps the distribution), with
no penalties, bias or logprobs (those requests decode one token a step as before, so
they stay as they were). A grammar's request keeps only the drafts its grammar
accepts (GrammarMatcher.draftable), and each of its verify rows is masked as that
position would be when decoded plainly (grammar_masks.py).

Two proposers, one per method (choice.py picks):
- NgramProposer ("ngram"): per request a PromptLookup over its prompt and accepted
  output, fed only the tokens added since the last step, forgotten when it ends.
- SuffixProposer ("suffix"): the same per request, plus a SuffixCache of the outputs
  of recent requests, which every request ending adds its output to. Of the two
  proposals the one matching the longer ending wins (then the longer one, then the
  request's own): an earlier answer that agrees with the request's last tens of
  tokens beats a 4-gram of its own.

Worked example, 4 drafts allowed, the request 3 tokens short of max_new_tokens: at
most 2 drafts are proposed (the verify step adds one token of its own), and the
step feeds the last token plus those 2.

How many it proposes adapts to what the request's last verify step kept: one more
than the drafts accepted there (all kept: twice as many as proposed), between 1 and
num_speculative_tokens. A verify row costs nearly a decode row where a step is
compute-bound (docs/speculative-decoding.md), so drafts that keep being rejected
shrink to a single cheap probe, while a request that keeps quoting reaches the cap
in a few steps. Of that allowance a step takes only the drafts worth their rows at
the measured cost of one more row (row_cost.py): all of them where rows are nearly
free, none where the step is compute-bound and the drafts are not nearly sure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..core.requests import RequestState
from .config import SpeculativeConfig
from .prompt_lookup import PromptLookup
from .row_cost import RowCost, acceptance_of
from .suffix_cache import SuffixCache


@dataclass
class SpeculationCounts:
    """Totals over an engine's verify steps, in vLLM's terms: a draft is one request's
    proposal in one step, of `num_draft_tokens` tokens, `num_accepted_tokens` kept;
    `accepted_per_position[i]`: how often the (i + 1)-th drafted token was kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class Proposer(Protocol):
    """All the scheduler and the engine loop know of a drafts' source (speculative
    decoding); the sources are this module's and draft_model.py's, chosen by
    choice.py. Calls come from the engine thread only."""

    counts: SpeculationCounts
    """What its drafts' verify steps kept, over the engine's life."""
    row_cost: RowCost
    """The decode steps' seconds by rows it was told of (record_step)."""

    def prepare(self, requests: list[RequestState], batch_size: int) -> None:
        """Before a step is built: the decoding requests that may take drafts in it."""

    def propose(self, request: RequestState, budget: int,
                batch_size: int) -> tuple[int, ...]:
        """Up to `budget` drafts for a decoding request (none: it decodes plainly)."""

    def accept(self, request: RequestState, proposed: int, accepted: int) -> None:
        """A verify step kept `accepted` of the request's `proposed` drafts: counted
        here and on the request."""

    def release(self, request: RequestState) -> None:
        """The request left the engine (finished, cancelled or failed)."""

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows (drafts included) took `seconds`."""


def speculates(request: RequestState) -> bool:
    """Whether the request's drafts can be judged from its rows' logits alone."""
    sampling = request.sampling
    return (not sampling.needs_token_counts and not sampling.logit_bias
            and not request.want_logprobs
            and not sampling.logprobs and sampling.top_logprobs == 0 and sampling.speculative)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.lookups: dict[str, PromptLookup] = {}
        self.limits: dict[str, int] = {}
        """request id -> drafts allowed next (after its first verify step)."""
        self.counts = SpeculationCounts()
        self.row_cost = RowCost()
        """Decode steps' seconds by rows: how many drafts are worth their rows."""

    def prepare(self, requests: list[RequestState], batch_size: int) -> None:
        """Before a step is built: the decoding requests that may take drafts in it
        (a proposer that drafts them together does it here; prompt lookup needs not)."""

    def limit(self, request: RequestState, batch_size: int, budget: int | None = None) -> int:
        """How many drafts the request may take now (0: none): its allowance, never
        past max_new_tokens or `budget`; none for a request that does not speculate or
        past disable_by_batch_size running requests, and no more than are worth their
        rows at the measured cost of one (row_cost.py) unless it is sampled with a seed
        (its tokens then hang on how many it drafts, which timing must not decide)."""
        config = self.config
        left = request.max_new_tokens - len(request.generated_tokens) - 1
        limit = min(self.limits.get(request.request_id, config.num_speculative_tokens), left)
        if budget is not None:
            limit = min(limit, budget)
        if (limit <= 0 or not speculates(request) or (config.disable_by_batch_size is not None
                                                       and batch_size >= config.disable_by_batch_size)):
            return 0
        if request.sampling.seed is not None and not request.sampling.is_greedy:
            return limit        # repeats itself: its drafts never hang on the timing
        counts = self.counts
        acceptance = acceptance_of(request.num_accepted_tokens, request.num_draft_tokens,
                                   counts.num_accepted_tokens, counts.num_draft_tokens)
        return self.row_cost.drafts_worth(acceptance, batch_size, limit)

    def propose(self, request: RequestState, budget: int, batch_size: int) -> tuple[int, ...]:
        """Up to `budget` drafts for a decoding request (fewer near max_new_tokens;
        none past disable_by_batch_size running requests or for requests that do not
        speculate)."""
        limit = self.limit(request, batch_size, budget)
        left = request.max_new_tokens - len(request.generated_tokens) - 1
        if limit <= 0:
            return ()
        drafts = tuple(self._propose(request, limit))
        if drafts and request.grammar is not None:
            drafts = request.grammar.draftable(drafts, left + 1)
        return drafts

    def _propose(self, request: RequestState, limit: int) -> list[int]:
        return self._lookup(request).propose(limit)[1]

    def _lookup(self, request: RequestState) -> PromptLookup:
        """The request's n-gram index, fed the tokens it gained since the last step."""
        lookup = self.lookups.get(request.request_id)
        if lookup is None:
            lookup = self.lookups[request.request_id] = PromptLookup(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        lookup.extend(request.tokens_between(len(lookup.tokens), request.num_tokens))
        return lookup

    def accept(self, request: RequestState, proposed: int, accepted: int) -> None:
        """The outcome of a verify step, counted; the next one proposes accepted + 1
        drafts, or twice as many when all were kept."""
        self.counts.count(proposed, accepted)
        request.num_draft_tokens += proposed
        request.num_accepted_tokens += accepted
        grown = accepted + 1 if accepted < proposed else 2 * proposed
        self.limits[request.request_id] = max(1, min(self.config.num_speculative_tokens, grown))

    def record_step(self, rows: int, seconds: float) -> None:
        self.row_cost.record(rows, seconds)

    def release(self, request: RequestState) -> None:
        """The request left the engine (finished, cancelled or failed)."""
        self.lookups.pop(request.request_id, None)
        self.limits.pop(request.request_id, None)


class SuffixProposer(NgramProposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.cache = SuffixCache(config.prompt_lookup_min, config.prompt_lookup_max,
                                 config.suffix_decoding_max_cached_requests,
                                 config.suffix_decoding_min_token_prob)

    def _propose(self, request: RequestState, limit: int) -> list[int]:
        lookup = self._lookup(request)
        own_n, own = lookup.propose(limit)
        shared_n, shared = self.cache.propose(lookup.tokens, limit)
        return shared if (shared_n, len(shared)) > (own_n, len(own)) else own

    def release(self, request: RequestState) -> None:
        """Its output (every token it accepted) joins the shared cache."""
        if request.generated_tokens:
            self.cache.add(request.generated_tokens)
        super().release(request)


"""RequestState: the engine thread's mutable record of one request.

Only the engine thread touches these objects; callers see immutable
`GenerationOutput` snapshots made by `to_output`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..generation_config import SamplingParams
from ..structured.grammar import GrammarMatcher
from ..outputs import GenerationOutput, RequestStatus
from ..pooling import Pooling


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    sampling: SamplingParams
    streaming: bool = False
    record_timestamps: bool = False
    want_logprobs: bool = False
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens of `prompt_ids + generated_tokens` whose K/V are in the cache. Each step
    the scheduler lets it catch up with `num_tokens`: the gap is a prompt (or a chunk
    of it) on the first steps, then the one token sampled last step."""
    block_ids: list[int] = field(default_factory=list)
    sliding_block_ids: list[int | None] = field(default_factory=list)
    """Blocks of the sliding-window layers (hybrid models), indexed like `block_ids`;
    None where the page fell out of the window and was recycled."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the full blocks of `prompt_ids + generated_tokens` computed so
    far (prefix caching); they stay valid across preemption since tokens never change."""
    num_registered_blocks: int = 0
    """How many of `block_ids` were offered to the prefix cache."""
    num_cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache at the last admission (whole pages, and
    the start of a page copied from a running request)."""
    offloaded_slots: list[int] = field(default_factory=list)
    """CPU pool slots holding this preempted request's K/V (CPU offload)."""
    offloaded_tokens: int = 0
    """How many tokens those slots hold: `num_computed_tokens` on restore."""
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    created_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    sampler_state: Any = None
    """Owned by the sampler (sampling.RequestSampling: the request's random stream and
    logit bias tensors), set when the engine takes the request."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens judged for this request, and kept."""
    num_accepted_tokens: int = 0
    grammar: GrammarMatcher | None = None
    """Constrained decoding: what the output must match (grammar.py); its matcher
    advances with every generated token."""
    pooling: Pooling | None = None
    """An embedding request (pooling.py): prefill only, then `embedding`."""
    pooled: Any = None
    """The pooled hidden state so far (a tensor of the runner's: a running sum for
    mean pooling), kept by the engine loop between the prompt's chunks."""
    embedding: list[float] | None = None

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated_tokens)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.generated_tokens

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 of prompt + generated, copying only those
        (called every step for every scheduled request)."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.generated_tokens[start - num_prompt:end - num_prompt]
        return self.prompt_ids[start:] + self.generated_tokens[:end - num_prompt]

    def append_token(self, token_id: int) -> None:
        """Record one sampled token and decide whether the request is done. As in
        transformers, an EOS token stays as the last generated token."""
        self.generated_tokens.append(token_id)
        if self.record_timestamps:
            self.timestamps.append(time.perf_counter())
        if token_id in self.eos_token_ids:
            self.status, self.finish_reason = RequestStatus.FINISHED, "stop"
        elif self.grammar is not None and not self._advance_grammar(token_id):
            return
        elif len(self.generated_tokens) >= self.max_new_tokens:
            self.status, self.finish_reason = RequestStatus.FINISHED, "length"
        else:
            self.status = RequestStatus.DECODING

    def _advance_grammar(self, token_id: int) -> bool:
        """Feed the grammar; False when that ended the request (complete: "stop",
        or a token the grammar refused: failed)."""
        self.grammar.accept(token_id)
        if self.grammar.error is not None:
            self.fail(f"the output left its grammar: {self.grammar.error}")
            return False
        if self.grammar.is_complete:
            self.status, self.finish_reason = RequestStatus.FINISHED, "stop"
            return False
        return True

    def fail(self, message: str) -> None:
        self.status, self.error = RequestStatus.FAILED, message

    def to_output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            generated_tokens=list(self.generated_tokens),
            status=self.status,
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            top_logprobs=[list(t) for t in self.top_logprobs] if self.sampling.top_logprobs else None,
            finish_reason=self.finish_reason,
            error=self.error,
            created_time=self.created_time,
            first_scheduled_time=self.first_scheduled_time,
            timestamps=list(self.timestamps) if self.record_timestamps else None,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            embedding=self.embedding,
        )

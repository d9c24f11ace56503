"""What crosses from the engine thread to callers: immutable result objects."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Lifecycle of one request inside the engine."""

    PENDING = "pending"
    """Queued, not yet scheduled (or preempted and waiting to resume)."""
    PREFILLING = "prefilling"
    """Its prompt is being fed to the model, possibly over several steps."""
    DECODING = "decoding"
    """Generating one token per step."""
    FINISHED = "finished"
    """Done: hit an EOS token or `max_new_tokens`. The last output of a request."""
    FAILED = "failed"
    """Aborted (hard stop, engine error); `GenerationOutput.error` says why."""


@dataclass(frozen=True)
class GenerationOutput:
    """One result for one request.

    Streaming requests get one of these per generated token (with the tokens so far);
    other requests get a single one when they finish. Instances are never mutated after
    they leave the engine thread, so any thread may read them.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    status: RequestStatus
    logprobs: list[float] | None = None
    """Log-probability of each generated token under the model (before sampling
    processors), when `return_logprobs` is on or the request asked for logprobs."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token, the `top_logprobs` most likely (token_id, logprob) pairs,
    when the request asked for them."""
    finish_reason: str | None = None
    """"stop" (EOS token) or "length" (`max_new_tokens`) once finished; else None."""
    error: str | None = None
    """Why the request failed, when `status` is FAILED."""
    created_time: float = 0.0
    """`time.perf_counter()` when the request was added."""
    first_scheduled_time: float | None = None
    """`time.perf_counter()` when it first entered a batch (None while queued);
    minus `created_time`, its time in the queue."""
    timestamps: list[float] | None = field(default=None)
    """`time.perf_counter()` of each generated token, when timestamps are recorded."""
    num_draft_tokens: int = 0
    """Speculative decoding: draft tokens this request's verify steps judged."""
    num_accepted_tokens: int = 0
    """Of those, how many it kept."""
    embedding: list[float] | None = None
    """An embedding request's pooled vector (engine/pooling.py), once finished; a
    classifying one's label logits ([num_labels])."""

    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)

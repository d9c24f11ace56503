"""GenerationPlan: one validated request, translated into engine terms.

OpenAI parameters map to `ContinuousBatchingManager.add_request` arguments:

    max_tokens / max_completion_tokens  -> max_new_tokens (checked against the context)
    temperature (default 1.0)           -> temperature, do_sample = temperature > 0
    top_p, top_k (-1/0 = off), min_p    -> top_p, top_k, min_p
    seed                                -> seed (+ the choice index when n > 1)
    presence/frequency/repetition_penalty, logit_bias -> the same names
    response_format                     -> grammar (compiled by structured_output.py)
    logprobs, top_logprobs              -> logprobs, top_logprobs
    ignore_eos, stop_token_ids          -> eos_token_id (model EOS unless ignored, + stop ids)
    speculative (ours; false: no drafts) -> speculative
    stop                                -> handled by the server (see stop_strings.py)

Unset parameters get OpenAI's defaults here, not the engine's, so a request means
the same thing on this server as on OpenAI's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .edge.errors import bad_request
from .protocol.common import GenerationFields
from .state import ServingState

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes [-2**63, 2**64)


@dataclass(frozen=True)
class GenerationPlan:
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None
    """Requested completion length; None = whatever the context leaves."""
    stop_strings: list[str]
    eos_token_ids: list[int]
    logprobs: bool
    top_logprobs: int
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt_param: str = "messages"
    """Where the prompt came from ("messages" or "prompt"), for error messages."""

    @property
    def engine_streaming(self) -> bool:
        """Ask the engine for every token when the client streams, and when stop
        strings must be watched (so the request can be cancelled as soon as one
        appears instead of running to max_tokens)."""
        return self.stream or bool(self.stop_strings)

    def max_new_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The completion budget for one prompt; 400 when it cannot fit. Without an
        explicit max_tokens, the budget is whatever the context leaves."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
        if prompt_len + max(max_tokens, 1) > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of "
                "the prompt or of max_tokens.",
                param="max_tokens" if self.max_tokens is not None else self.prompt_param,
                code="context_length_exceeded")
        return max_tokens

    def sampling_for_choice(self, index: int) -> dict[str, Any]:
        """add_request sampling kwargs for choice `index`: seeds differ per choice so
        n > 1 gives n different, reproducible samples."""
        kwargs = dict(self.sampling)
        if kwargs.get("seed") is not None:
            kwargs["seed"] = (kwargs["seed"] + index) % _SEED_MODULUS
        return kwargs


def build_plan(request: GenerationFields, state: ServingState, *, max_tokens: int | None,
               logprobs: bool, top_logprobs: int, grammar: Any = None) -> GenerationPlan:
    """`grammar`: the CompiledGrammar of the request's response_format, if any."""
    temperature = 1.0 if request.temperature is None else request.temperature
    sampling: dict[str, Any] = {
        "do_sample": temperature > 0.0,
        "temperature": temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": max(request.top_k or 0, 0),
        "min_p": request.min_p or 0.0,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "repetition_penalty": request.repetition_penalty or 1.0,
        "logit_bias": _logit_bias(request.logit_bias, state.vocab_size),
        "speculative": request.speculative is not False,
    }
    if grammar is not None:
        sampling["grammar"] = grammar
    if logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top_logprobs
    stop_ids = list(request.stop_token_ids or [])
    for token_id in stop_ids:
        if token_id >= state.vocab_size:
            raise bad_request(f"Token id {token_id} is outside the vocabulary.",
                              param="stop_token_ids")
    eos = [] if request.ignore_eos else list(state.eos_token_ids)
    eos += [t for t in stop_ids if t not in eos]
    return GenerationPlan(
        n=request.n or 1, stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        max_tokens=max_tokens, stop_strings=request.stop_strings, eos_token_ids=eos,
        logprobs=logprobs, top_logprobs=top_logprobs, sampling=sampling,
        prompt_param="messages" if hasattr(request, "messages") else "prompt")


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """Keys (ASCII decimal token ids, checked by the schema) -> ids within the
    vocabulary; at most one entry per token of the vocabulary."""
    if not bias:
        return None
    if len(bias) > vocab_size:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {vocab_size} (one per "
                          "token of the vocabulary) are allowed.", param="logit_bias")
    result = {}
    for key, value in bias.items():
        token_id = int(key)
        if token_id >= vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary.",
                              param="logit_bias")
        result[token_id] = float(value)
    return result

"""ChoiceDecoder: one engine request's outputs -> the text deltas of one choice.

Each GenerationOutput carries *all* tokens generated so far; the decoder remembers
how many it has consumed and handles only the new ones, one token at a time:

    token -> IncrementalDetokenizer (whole characters only)
          -> StopStringMatcher     (hold back a possible stop-string prefix, cut at a match)
          -> ChoiceDelta           (text to send, the tokens behind it, their logprobs)

Streaming and non-streaming requests take exactly this path, so their texts agree.
Two rules from the engine's contract live here:
- a request that ends on EOS (finish_reason "stop") has the EOS token as its last
  generated token: it counts in usage but is not text and gets no logprob entry;
- after a stop-string match the choice is over (finish_reason "stop"); the caller
  cancels the engine request, and tokens that still arrive are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import GenerationOutput

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher

# Stands in for a logprob the engine did not report (OpenAI uses the same value);
# JSON has no NaN or -inf.
MISSING_LOGPROB = -9999.0


@dataclass
class ChoiceDelta:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    """Tokens consumed in this step that belong to the text (not a final EOS)."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.token_ids and self.finish_reason is None


class ChoiceDecoder:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop_strings: list[str],
                 eos_token_ids: list[int], want_logprobs: bool = False) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stop_strings)
        self._eos = set(eos_token_ids)
        self._want_logprobs = want_logprobs
        self.num_generated = 0
        """Generated tokens consumed so far: the choice's completion_tokens."""
        self.finish_reason: str | None = None

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the choice, if one did."""
        return self._stops.matched

    def step(self, output: GenerationOutput) -> ChoiceDelta:
        """Consume the tokens of `output` not seen before."""
        if self.finish_reason is not None:
            return ChoiceDelta()
        tokens = output.generated_tokens
        start = self.num_generated
        new = tokens[start:]
        ended = output.is_finished()
        ends_on_eos = ended and output.finish_reason == "stop" and bool(new) and new[-1] in self._eos
        pieces: list[str] = []
        used: list[int] = []  # absolute positions of the tokens that became text
        for offset, token_id in enumerate(new):
            self.num_generated += 1
            if ends_on_eos and offset == len(new) - 1:
                break
            used.append(start + offset)
            pieces.append(self._stops.feed(self._detokenizer.add(token_id)))
            if self._stops.matched is not None:
                self.finish_reason = "stop"
                break
        if ended and self.finish_reason is None:
            pieces.append(self._stops.feed(self._detokenizer.flush()))
            pieces.append(self._stops.flush())
            matched = self._stops.matched is not None
            self.finish_reason = "stop" if matched else (output.finish_reason or "stop")
        delta = ChoiceDelta(text="".join(pieces), token_ids=[tokens[i] for i in used],
                            finish_reason=self.finish_reason)
        if self._want_logprobs:
            delta.logprobs, delta.top_logprobs = _logprobs_at(output, used)
        return delta


def _logprobs_at(output: GenerationOutput, positions: list[int]):
    """The logprobs (and top alternatives) of the tokens at `positions`.

    Lists in an output cover either every generated token or only the newest ones;
    `shift` maps an absolute position to an index into them either way.
    """
    total = len(output.generated_tokens)
    logprobs = top = None
    if output.logprobs is not None:
        shift = total - len(output.logprobs)
        logprobs = [output.logprobs[p - shift] if p >= shift else MISSING_LOGPROB for p in positions]
    if output.top_logprobs is not None:
        shift = total - len(output.top_logprobs)
        top = [list(output.top_logprobs[p - shift]) if p >= shift else [] for p in positions]
    return logprobs, top

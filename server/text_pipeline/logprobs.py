"""Logprobs in the two shapes OpenAI uses.

Chat completions (one entry per token, alternatives nested):

    {"content": [{"token": " Paris", "logprob": -0.01, "bytes": [32, 80, ...],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.01, "bytes": [...]}, ...]}],
     "refusal": null}

Legacy completions (parallel lists, alternatives as token -> logprob maps):

    {"tokens": [" Paris"], "token_logprobs": [-0.01],
     "top_logprobs": [{" Paris": -0.01, " Lyon": -5.2}], "text_offset": [12]}
"""

from __future__ import annotations

from typing import Any

from .choice_decoder import MISSING_LOGPROB, ChoiceDelta
from .token_text import TokenTexts


def chat_logprobs(delta: ChoiceDelta, texts: TokenTexts) -> dict[str, Any]:
    content = []
    logprobs = delta.logprobs or []
    tops = delta.top_logprobs or []
    for i, token_id in enumerate(delta.token_ids):
        text, raw = texts.get(token_id)
        alternatives = []
        for alt_id, alt_logprob in (tops[i] if i < len(tops) else []):
            alt_text, alt_raw = texts.get(alt_id)
            alternatives.append({"token": alt_text, "logprob": float(alt_logprob),
                                 "bytes": alt_raw})
        content.append({"token": text,
                        "logprob": float(logprobs[i]) if i < len(logprobs) else MISSING_LOGPROB,
                        "bytes": raw, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Accumulates legacy completion logprobs; `text_offset` counts characters from
    the start of the choice's text (after any echoed prompt)."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0) -> None:
        self._texts = texts
        self._offset = start_offset

    def format(self, delta: ChoiceDelta) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        logprobs = delta.logprobs or []
        tops = delta.top_logprobs or []
        for i, token_id in enumerate(delta.token_ids):
            text, _ = self._texts.get(token_id)
            logprob = float(logprobs[i]) if i < len(logprobs) else MISSING_LOGPROB
            alternatives = {self._texts.get(alt)[0]: float(lp)
                            for alt, lp in (tops[i] if i < len(tops) else [])}
            alternatives.setdefault(text, logprob)  # the sampled token is always listed
            tokens.append(text)
            token_logprobs.append(logprob)
            top_logprobs.append(alternatives)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate the per-delta dicts of one choice into one."""
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for part in parts:
        for key in merged:
            merged[key].extend(part[key])
    return merged

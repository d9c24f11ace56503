"""Prompt lookup ("ngram" speculation): propose the tokens that followed the last
occurrence of the sequence's current ending earlier in the same sequence.

Answers that quote, edit or repeat their input (code edits, summaries with quotes,
a tool call's JSON echoed back) continue spans of their own prompt; matching the
last n tokens against the earlier text and copying what came after them proposes
those spans for free. Worked example (n = 2, k = 3):

    tokens  = [5, 8, 2, 9, 4, 1, 5, 8]        the ending [5, 8] occurred at 0..1
    propose -> (2, [2, 9, 4])                  what followed it there, n = 2

Longer matches are tried first (`max_n` down to `min_n`): a longer shared ending is
more likely to continue the same way. Among occurrences the most recent wins.

The index is built incrementally, one dict per n from n-gram to the position that
followed its latest occurrence, so a step costs O(new tokens x n values) whatever
the context length; it holds one entry per distinct n-gram (bounded by the
sequence's length times the n values). Plain Python: the engine's scheduling side
imports no torch.
"""

from __future__ import annotations

from typing import Sequence


class PromptLookup:
    """The n-gram index of one request's tokens (prompt, then output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.follows: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}
        """n -> n-gram -> the index of the token after its latest occurrence that has
        one (so never the sequence's own ending)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens: the prompt first, then the tokens each step accepts (drafts
        are never appended, so nothing is ever taken back)."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        # every n-gram ending at position e with a token after it (e <= len - 2),
        # for the positions that gained a follower with this call
        for end in range(max(start - 1, 0), len(self.tokens) - 1):
            for n, table in self.follows.items():
                if end + 1 >= n:
                    table[tuple(self.tokens[end + 1 - n:end + 1])] = end + 1

    def propose(self, k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens) that followed the longest ending of n tokens seen
        before; (0, []) when no ending of min_n or more tokens occurred earlier."""
        if k <= 0:
            return 0, []
        size = len(self.tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            follower = self.follows[n].get(tuple(self.tokens[size - n:]))
            if follower is not None:
                return n, self.tokens[follower:follower + k]
        return 0, []

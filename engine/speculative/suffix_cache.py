"""The shared half of suffix decoding: the outputs of recent requests, indexed so a
running request's ending finds how earlier answers went on after the same tokens.

Agent loops and templated answers repeat themselves across requests: the same tool
call with the same JSON, the same closing sentence, the same answer to the same
question. A request's own prompt and output (prompt_lookup.py) cannot propose an
answer it has not written yet; the answers of earlier requests can.

The index maps every n-gram of a cached output (n from `min_n` to `max_n`) to its
latest `OCCURRENCES` places with a token after them. Proposing from an ending:
the longest n-gram of the ending that occurs is taken; of its occurrences, those
whose earlier tokens agree with the ending furthest back (up to MAX_MATCH tokens)
are kept, as the deepest node of a suffix tree would keep them, and walked forward
together: at each depth the token most of the surviving occurrences continue with
is proposed and the others drop out. The walk stops where that token's estimated probability (the product of
its shares so far) falls below `min_token_prob`, or no occurrence goes further.
Worked example (n = 2, min_token_prob 0.3):

    cached outputs  [7, 3, 4, 5, 6]   [7, 3, 4, 5, 9]   [1, 7, 3, 8]
    ending 0, 7, 3 -> occurrences of (7, 3): three, continuing 4, 4, 8; none
                      has 0 before it, so all three agree 2 tokens back
    depth 0: 4 (2 of 3, p 0.67)   depth 1: 5 (2 of 2, p 0.67)
    depth 2: 6 or 9 (1 of 2 each, p 0.33; the later output wins a tie) -> [4, 5, 9]

Memory is bounded by `max_requests` outputs: the oldest output is evicted, and its
index entries with it, when one more arrives. Plain Python (the scheduler's side
imports no torch); engine thread only.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Sequence

OCCURRENCES = 8
"""Places kept per n-gram, the latest: what the walk's shares are estimated from."""
MAX_MATCH = 64
"""How far back an occurrence's agreement with the ending is measured."""


class SuffixCache:
    def __init__(self, min_n: int, max_n: int, max_requests: int,
                 min_token_prob: float) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix cache needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_requests = max_requests
        self.min_token_prob = min_token_prob
        self.outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        """output id -> its tokens, oldest first."""
        self.places: dict[tuple[int, ...], deque[tuple[int, int]]] = {}
        """n-gram -> (output id, index of the token after it), latest last."""
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.outputs)

    def add(self, tokens: Sequence[int]) -> None:
        """Cache one finished output (evicting the oldest past `max_requests`)."""
        if len(tokens) < self.min_n + 1 or self.max_requests == 0:
            return
        output_id, self._next_id = self._next_id, self._next_id + 1
        tokens = tuple(tokens)
        self.outputs[output_id] = tokens
        for key, follower in self._ngrams(tokens):
            places = self.places.get(key)
            if places is None:
                places = self.places[key] = deque(maxlen=OCCURRENCES)
            places.append((output_id, follower))
        while len(self.outputs) > self.max_requests:
            self._evict(*self.outputs.popitem(last=False))

    def _ngrams(self, tokens: tuple[int, ...]):
        """(n-gram, index after it) for every n-gram of tokens with a token after it."""
        for end in range(len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                yield tokens[end + 1 - n:end + 1], end + 1

    def _evict(self, output_id: int, tokens: tuple[int, ...]) -> None:
        for key, _ in self._ngrams(tokens):
            places = self.places.get(key)
            if places is None:
                continue
            kept = [place for place in places if place[0] != output_id]
            if not kept:
                del self.places[key]
            elif len(kept) < len(places):
                self.places[key] = deque(kept, maxlen=OCCURRENCES)

    def propose(self, ending: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(match, up to k tokens) continuing the longest n-gram of `ending` (its
        last MAX_MATCH tokens are read) the cache holds, n from max_n down to min_n;
        match: how many of the ending's last tokens the kept occurrences agree with.
        (0, []) when none goes on."""
        if k <= 0:
            return 0, []
        ending = list(ending[len(ending) - MAX_MATCH:])
        for n in range(min(self.max_n, len(ending)), self.min_n - 1, -1):
            places = self.places.get(tuple(ending[len(ending) - n:]))
            if not places:
                continue
            found = [(self.outputs[output_id], at) for output_id, at in reversed(places)]
            agreements = [_agreement(tokens, at, ending, n) for tokens, at in found]
            match = max(agreements)
            tokens = self._walk([place for place, agreement in zip(found, agreements)
                                 if agreement == match], k)
            if tokens:
                return match, tokens
        return 0, []

    def _walk(self, alive: list[tuple[tuple[int, ...], int]], k: int) -> list[int]:
        """The most shared continuation of the places `alive` (latest first, which
        wins a tie)."""
        proposed: list[int] = []
        probability = 1.0
        while len(proposed) < k and alive:
            depth = len(proposed)
            shares = Counter(tokens[at + depth] for tokens, at in alive
                             if at + depth < len(tokens))
            if not shares:
                break
            token, count = shares.most_common(1)[0]     # ties: the first seen, the latest
            probability *= count / len(alive)
            if probability < self.min_token_prob:
                break
            proposed.append(token)
            alive = [(tokens, at) for tokens, at in alive
                     if at + depth < len(tokens) and tokens[at + depth] == token]
        return proposed


def _agreement(tokens: tuple[int, ...], at: int, ending: list[int], n: int) -> int:
    """How many tokens before `at` in `tokens` equal the ending's last ones (at
    least the n of the n-gram found there)."""
    length = n
    while (length < len(ending) and length < at
           and tokens[at - 1 - length] == ending[len(ending) - 1 - length]):
        length += 1
    return length


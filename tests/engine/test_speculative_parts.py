"""The parts of speculative decoding that stand alone (engine/speculative/): prompt
lookup against a brute-force search, the greedy verify rule, rejection sampling's
output distribution (chi-squared against the target's), and the setting's checks."""

from __future__ import annotations

import random
import re

import pytest
import torch

from engine.speculative.acceptance import verify_greedy, verify_sampled
from engine.speculative.config import SpeculativeConfig
from engine.speculative.prompt_lookup import PromptLookup
from engine.speculative.suffix_cache import SuffixCache


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest ending (max_n down to min_n) found earlier, its latest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ending = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == ending:
                return tokens[start + n:start + n + k]
    return []


def test_the_worked_example():
    lookup = PromptLookup(2, 2)
    lookup.extend([5, 8, 2, 9, 4, 1, 5, 8])
    assert lookup.propose(3) == (2, [2, 9, 4])
    assert lookup.propose(0) == (0, [])
    lookup.extend([7])                              # [8, 7] never occurred
    assert lookup.propose(3) == (0, [])


@pytest.mark.parametrize("seed", range(6))
def test_the_index_agrees_with_a_search_as_tokens_arrive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])                  # small vocabularies repeat often
    min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
    lookup, tokens = PromptLookup(min_n, max_n), []
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    lookup.extend(prompt)
    tokens.extend(prompt)
    for _ in range(60):
        k = rng.randrange(1, 6)
        assert lookup.propose(k)[1] == brute_force(tokens, min_n, max_n, k), (tokens, k)
        step = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        lookup.extend(step)
        tokens.extend(step)


def test_the_suffix_caches_worked_example():
    cache = SuffixCache(2, 2, max_requests=10, min_token_prob=0.3)
    for output in ([7, 3, 4, 5, 6], [7, 3, 4, 5, 9], [1, 7, 3, 8]):
        cache.add(output)
    assert cache.propose([0, 7, 3], 8) == (2, [4, 5, 9])
    assert cache.propose([0, 7, 3], 2) == (2, [4, 5])
    assert cache.propose([7, 2], 8) == (0, [])                  # (7, 2) never cached
    strict = SuffixCache(2, 2, max_requests=10, min_token_prob=0.5)
    for output in ([7, 3, 4, 5, 6], [7, 3, 4, 5, 9], [1, 7, 3, 8]):
        strict.add(output)
    assert strict.propose([7, 3], 8) == (2, [4, 5])             # 9 at p 0.33: cut


def test_the_suffix_cache_prefers_longer_endings_and_evicts_the_oldest():
    cache = SuffixCache(1, 3, max_requests=2, min_token_prob=0.1)
    cache.add([1, 2, 3, 10, 11])
    cache.add([9, 2, 3, 20, 21])
    assert cache.propose([1, 2, 3], 2) == (3, [10, 11])         # (1, 2, 3) beats (2, 3)
    assert cache.propose([5, 2, 3], 2) == (2, [20, 21])         # a tie: the latest
    cache.add([4, 4, 4, 4])                                     # evicts the first output
    assert len(cache) == 2
    assert cache.propose([1, 2, 3], 2) == (2, [20, 21])
    assert all(place[0] != 0 for places in cache.places.values() for place in places)
    assert (1, 2) not in cache.places and (1,) not in cache.places


def test_the_suffix_cache_follows_the_occurrence_agreeing_furthest_back():
    """A 2-gram index, yet the earlier context picks the place: an answer repeated
    word for word is followed where it is, not where a phrase of it recurs."""
    cache = SuffixCache(2, 2, max_requests=10, min_token_prob=0.1)
    cache.add([1, 2, 3, 4, 8, 9, 3, 4, 5, 6])      # (3, 4) twice, going on 8 and 5
    cache.add([7, 7, 3, 4, 0, 0])                  # and later, going on 0
    assert cache.propose([1, 2, 3, 4], 3) == (4, [8, 9, 3])
    assert cache.propose([8, 9, 3, 4], 3) == (4, [5, 6])
    assert cache.propose([5, 5, 3, 4], 3) == (2, [0, 0])      # no context: the latest wins


@pytest.mark.parametrize("seed", range(3))
def test_the_suffix_cache_agrees_with_a_search_over_its_outputs(seed):
    """With one occurrence per n-gram in view, the walk is the latest continuation."""
    rng = random.Random(seed)
    cache = SuffixCache(1, 3, max_requests=4, min_token_prob=0.0)
    outputs = [[rng.randrange(6) for _ in range(rng.randrange(2, 30))] for _ in range(7)]
    for output in outputs:
        cache.add(output)
    kept = outputs[-4:]
    for _ in range(50):
        ending = [rng.randrange(6) for _ in range(3)]
        n, proposed = cache.propose(ending, 4)
        longest = 0
        for size in range(3, 0, -1):
            if any(out[i:i + size] == ending[3 - size:] for out in kept
                   for i in range(len(out) - size)):
                longest = size
                break
        assert n == longest
        if n:       # the proposal continues some cached occurrence of that ending
            assert any(out[i:i + n] == ending[3 - n:] and out[i + n:i + n + len(proposed)] == proposed
                       for out in kept for i in range(len(out) - n))


def test_lookup_sizes_are_checked():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        PromptLookup(3, 2)


def test_greedy_keeps_the_agreeing_prefix_and_adds_one():
    assert verify_greedy([4, 7, 1, 9], [4, 7, 1]).tokens_emitted == 4      # all + bonus 9
    assert verify_greedy([4, 7, 1, 9], [4, 7, 1]).next_token == 9
    assert verify_greedy([4, 7, 1, 9], [4, 2, 1]) == verify_greedy([4, 7], [4])  # (1, 7)
    assert verify_greedy([3], []).next_token == 3                   # no drafts: a decode
    with pytest.raises(ValueError, match="3 drafts need 4 scored rows"):
        verify_greedy([1, 2], [1, 2, 3])


def _chi_squared(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft_model", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(draft_model):
    """The first emitted token is distributed as p_0 whatever is drafted: with a
    copied draft (a point mass) and with a draft model's own distribution.
    Critical value of chi-squared with 5 degrees of freedom at p = 0.001: 20.5."""
    generator = torch.Generator().manual_seed(7)
    vocab, trials = 6, 12000
    probs = torch.softmax(torch.randn(3, vocab, generator=generator), dim=-1)
    draft_probs = torch.softmax(torch.randn(2, vocab, generator=generator), dim=-1) \
        if draft_model else None
    counts = torch.zeros(vocab)
    for _ in range(trials):
        drafts = [int(torch.multinomial(draft_probs[i], 1, generator=generator))
                  for i in range(2)] if draft_model else [2, 2]
        verdict = verify_sampled(probs, drafts, draft_probs, generator)
        first = drafts[0] if verdict.accepted > 0 else verdict.next_token
        counts[first] += 1
    assert _chi_squared(counts, probs[0]) < 20.5
    # a draft model whose distributions are the target's is always kept (p / q = 1)
    assert verify_sampled(probs, [0, 3], probs[:2], generator).accepted == 2


def test_a_seeded_verify_repeats_itself():
    probs = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(3)), -1)
    runs = [verify_sampled(probs, [1, 4, 2], None, torch.Generator().manual_seed(11))
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    with pytest.raises(ValueError, match=r"3 drafts need probs of shape \[4, vocab\]"):
        verify_sampled(probs[:2], [1, 4, 2])


def test_a_certain_draft_is_always_kept():
    probs = torch.zeros(3, 5)
    probs[0, 1] = probs[1, 3] = probs[2, 0] = 1.0
    assert verify_sampled(probs, [1, 3]) == verify_greedy([1, 3, 0], [1, 3])


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle"}', "method must be one of ngram, suffix, draft_model, got 'eagle'"),
    ('{"method": "draft_model"}', "model: required for method draft_model"),
    ('{"method": "ngram", "model": "x.gguf"}', "model: required for method draft_model"),
    ('{"method": "draft_model", "model": 3}', "model must be a non-empty string"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}',
     "suffix_decoding_min_token_prob must be a number in [0, 1], got 1.5"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
     "suffix_decoding_max_cached_requests must be an integer >= 0"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "prompt_lookup_min": 5}', "prompt_lookup_min (5) must not exceed"),
    ('{"method": "ngram", "lookahead": 2}', "unknown keys ['lookahead']"),
    ('{"num_speculative_tokens": 2}', "method is required"),
    ("[1]", "must be a JSON object"),
    ("{method", "is not JSON"),
])
def test_the_setting_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SpeculativeConfig.from_any(text)


def test_the_setting_reads_vllms_shape():
    config = SpeculativeConfig.from_any('{"method": "ngram", "num_speculative_tokens": 3, '
                                        '"prompt_lookup_max": 5, "prompt_lookup_min": 1}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == ("ngram", 3, 5, 1)
    assert SpeculativeConfig.from_any(config.as_dict()) == config
    assert SpeculativeConfig.from_any("") is None and SpeculativeConfig.from_any(None) is None

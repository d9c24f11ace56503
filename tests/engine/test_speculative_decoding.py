"""Speculative decoding in the engine (engine/speculative/, the scheduler's drafts, the
verify rows in batch.py and runner.py, engine_loop's settling): greedy requests give
exactly the tokens they give without it, in batches mixing prefill chunks, prefix
hits and preemption; the drafts' pages are given back; requests that cannot be
verified from raw logits never take drafts; the counters move."""

from __future__ import annotations

import logging

import pytest

from engine import ContinuousBatchingConfig, GenerationConfig
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase: tiny random models then loop too, so the
    proposer finds drafts that are right and drafts that are wrong."""
    phrases = random_prompts(count, 2, 5, seed=seed)
    tails = random_prompts(count, 0, 6, seed=seed + 1)
    return [phrase * 4 + tail for phrase, tail in zip(phrases, tails)]


def run_both(model, prompts, max_new_tokens: int, **config):
    plain = generate_and_inspect(model, prompts, max_new_tokens, **config)
    speculated = generate_and_inspect(model, prompts, max_new_tokens,
                                      speculative_config=NGRAM, **config)
    return plain, speculated


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_are_those_of_plain_decoding(family, tiny_models):
    from engine import load_model

    path, reference = tiny_models[family]
    model = load_model(path, progress=False)
    prompts = looping_prompts(6, seed=3) + random_prompts(2, 5, 40, seed=4)
    (plain, plain_stats), (tokens, stats) = run_both(model, prompts, 24)
    assert tokens == plain
    assert tokens[0] == reference_greedy(reference, prompts[0], 24)
    assert stats["spec_decode"] == 1 and stats["spec_num_drafts"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
    assert stats["num_steps"] < plain_stats["num_steps"]       # tokens several at a time
    assert 0 < stats["spec_timed_steps"] <= stats["num_steps"]  # what a row costs, measured


def test_chunked_prefill_prefix_hits_and_preemption(tiny_llama):
    """Small steps (prompts prefilled in chunks beside verify rows), shared prefixes
    (pages from the cache; drafts never offered to it) and a cache so small that
    requests are preempted and recomputed."""
    model, _ = tiny_llama
    shared = looping_prompts(1, seed=8)[0] * 3
    prompts = [shared + tail for tail in random_prompts(5, 1, 12, seed=9)]
    for config in ({"max_batch_tokens": 16}, {"page_size": 16},
                   {"page_size": 16, "num_blocks": 14, "max_batch_tokens": 64}):
        (plain, _), (tokens, stats) = run_both(model, prompts, 30, **config)
        assert tokens == plain, config
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], config
    assert stats["num_preemptions"] > 0                 # (rejected drafts rolled back too)


def test_suffix_proposes_earlier_answers_and_keeps_greedy_tokens(tiny_llama):
    """The same prompts answered twice by one manager: the second time the earlier
    answers (the shared suffix cache) are proposed and most are kept, where
    prompt lookup alone finds little; the tokens stay those of plain decoding."""
    from engine import GenerationConfig

    model, _ = tiny_llama
    prompts = random_prompts(4, 6, 20, seed=21)
    config = GenerationConfig(max_new_tokens=24, eos_token_id=[])
    plain = [o.generated_tokens for o in model.generate_batch(
        prompts, config, ContinuousBatchingConfig()).values()]
    counts = {}
    for method in ("ngram", "suffix"):
        manager = model.init_continuous_batching(config, ContinuousBatchingConfig(
            speculative_config={**NGRAM, "method": method}))
        manager.start()
        try:
            for run in range(2):
                ids = [manager.add_request(p, max_new_tokens=24) for p in prompts]
                results = {}
                while len(results) < len(ids):
                    result = manager.get_result(timeout=60)
                    results[result.request_id] = result
                assert [results[i].generated_tokens for i in ids] == plain, (method, run)
            manager.check_invariants()
            counts[method] = (sum(r.num_accepted_tokens for r in results.values()),
                              sum(r.num_draft_tokens for r in results.values()))
        finally:
            manager.stop()
    accepted, drafted = counts["suffix"]
    assert accepted >= 0.8 * drafted and accepted >= 2 * counts["ngram"][0], counts


def test_a_draft_model_keeps_the_greedy_tokens(tiny_models):
    """A draft model run by the engine's runner over its own paged cache: the target
    drafting for itself keeps nearly every draft (only batch-shape rounding may
    differ); a random draft of another family keeps few; the tokens are plain
    decoding's either way, and every draft page is given back."""
    from engine import GenerationConfig, load_model

    target_path = tiny_models["llama"][0]
    model = load_model(target_path, progress=False)
    prompts = looping_prompts(3, seed=5) + random_prompts(3, 5, 30, seed=6)
    config = GenerationConfig(max_new_tokens=20, eos_token_id=[])
    plain = [o.generated_tokens for o in model.generate_batch(
        prompts, config, ContinuousBatchingConfig(max_batch_tokens=32)).values()]
    rates = {}
    for name, draft in (("self", target_path), ("qwen3", tiny_models["qwen3"][0])):
        manager = model.init_continuous_batching(config, ContinuousBatchingConfig(
            max_batch_tokens=32, speculative_config={
                "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}))
        manager.start()
        try:
            ids = [manager.add_request(p, max_new_tokens=20) for p in prompts]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                results[result.request_id] = result
            manager.check_invariants()
            proposer = manager.loop.scheduler.proposer
            assert not proposer.shadows
            drafted = sum(r.num_draft_tokens for r in results.values())
            assert proposer.num_steps < drafted / 2        # the requests' steps batched
            assert proposer.allocator.num_free_blocks == proposer.allocator.num_blocks
        finally:
            manager.stop()
        assert [results[i].generated_tokens for i in ids] == plain, name
        drafted = sum(r.num_draft_tokens for r in results.values())
        rates[name] = sum(r.num_accepted_tokens for r in results.values()) / drafted
    assert rates["self"] >= 0.9 and rates["qwen3"] < rates["self"], rates


def test_a_draft_model_must_share_the_vocabulary(tiny_llama, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import GenerationConfig

    model, _ = tiny_llama
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not share the served model's vocabulary"):
        model.init_continuous_batching(GenerationConfig(), ContinuousBatchingConfig(
            speculative_config={"method": "draft_model", "model": str(tmp_path)}))


def test_max_tokens_and_eos_stop_where_they_would(tiny_llama):
    model, _ = tiny_llama
    prompts = looping_prompts(4, seed=12)
    plain, _ = generate_and_inspect(model, prompts, 24)
    eos = plain[0][9]                            # a token the first answer reaches
    for new in (1, 2, 5, 7):
        config = GenerationConfig(max_new_tokens=new, eos_token_id=[eos])
        off = model.generate_batch(prompts, config, ContinuousBatchingConfig())
        on = model.generate_batch(prompts, config,
                                  ContinuousBatchingConfig(speculative_config=NGRAM))
        got = [o.generated_tokens for o in on.values()]
        assert got == [o.generated_tokens for o in off.values()]
        assert all(len(t) <= new for t in got)


def test_requests_that_need_more_than_raw_logits_take_no_drafts(tiny_llama):
    """Penalties and logprobs: one token a step, as without speculation."""
    model, _ = tiny_llama
    prompts = looping_prompts(3, seed=20)
    penalized = GenerationConfig(max_new_tokens=12, repetition_penalty=1.3, eos_token_id=[])
    off = model.generate_batch(prompts, penalized, ContinuousBatchingConfig())
    on = model.generate_batch(prompts, penalized, ContinuousBatchingConfig(
        speculative_config=NGRAM), persistent_manager=True)
    assert model.kept_manager.stats()["spec_num_drafts"] == 0
    model.kept_manager.destroy()
    assert [o.generated_tokens for o in on.values()] == [o.generated_tokens for o in off.values()]
    logprobs = ContinuousBatchingConfig(return_logprobs=True, speculative_config=NGRAM)
    greedy = GenerationConfig(max_new_tokens=12, eos_token_id=[])
    with_logprobs = model.generate_batch(prompts, greedy, logprobs, persistent_manager=True)
    assert model.kept_manager.stats()["spec_num_drafts"] == 0
    model.kept_manager.destroy()
    plain = model.generate_batch(prompts, greedy, ContinuousBatchingConfig(return_logprobs=True))
    assert [o.logprobs for o in with_logprobs.values()] == [o.logprobs for o in plain.values()]


def test_sampled_requests_speculate_and_a_seeded_one_repeats_itself(tiny_llama):
    model, _ = tiny_llama
    prompts = looping_prompts(3, seed=21)
    sampled = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=20,
                               eos_token_id=[])
    runs = []
    for _ in range(2):
        outputs = model.generate_batch(prompts, sampled, ContinuousBatchingConfig(
            seed=3, speculative_config=NGRAM), persistent_manager=True)
        stats = model.kept_manager.stats()
        model.kept_manager.check_invariants()
        model.kept_manager.destroy()
        assert stats["spec_num_drafts"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert stats["spec_timed_steps"] == 0      # drafts never hang on timing under a seed
        runs.append([o.generated_tokens for o in outputs.values()])
    assert runs[0] == runs[1] and all(len(tokens) == 16 for tokens in runs[0])


def test_the_samplers_verdicts_keep_the_processed_distribution():
    """Sampler.verify over rows after temperature and top-k: the first emitted token
    is distributed as the processed first row (chi-squared, 7 degrees of freedom,
    p = 0.001: 24.3), whatever is drafted."""
    import torch

    from engine.generation_config import SamplingParams
    from engine.core.requests import RequestState
    from engine.step.sampling import Sampler

    sampler = Sampler(torch.device("cpu"), seed=9)
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=8)
    request = RequestState("r", [1, 2], 8, (), params)
    sampler.init_request(request)
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(4)) * 2
    target = sampler._processed_probs(logits[:1], [params])[0]
    support = target > 0
    counts = torch.zeros(12)
    for _ in range(8000):
        verdict = sampler.verify(logits, request, (int(target.argmax()), 5), [0, 0, 0])
        counts[int(target.argmax()) if verdict.accepted else verdict.next_token] += 1
    assert counts[~support].sum() == 0
    expected = target[support] * counts.sum()
    assert float(((counts[support] - expected) ** 2 / expected).sum()) < 24.3


def test_sliding_models_decode_plainly_and_say_why(tiny_mistral, caplog):
    model, _ = tiny_mistral
    with caplog.at_level(logging.WARNING, logger="engine.speculative.choice"):
        _, stats = generate_and_inspect(model, looping_prompts(2, seed=30), 8,
                                        speculative_config=NGRAM)
    assert stats["spec_decode"] == 0
    assert "speculative decoding off: sliding-window layers" in caplog.text


def test_disable_by_batch_size(tiny_llama):
    """At 3 running requests or more, steps decode plainly (all 4 run to the end
    together here); 2 requests speculate."""
    model, _ = tiny_llama
    capped = dict(NGRAM, disable_by_batch_size=3)
    _, stats = generate_and_inspect(model, looping_prompts(4, seed=40), 16,
                                    speculative_config=capped)
    _, few_stats = generate_and_inspect(model, looping_prompts(2, seed=40), 16,
                                        speculative_config=capped)
    assert stats["spec_num_drafts"] == 0 and few_stats["spec_num_drafts"] > 0

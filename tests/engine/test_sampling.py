"""Sampling: per-request parameters in one batch, seeds, logprobs."""

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig

from tests.helpers import random_prompts, reference_greedy


def generate(model, prompts, max_new_tokens=8, config=None, **kwargs):
    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[]),
        config or ContinuousBatchingConfig(page_size=4, num_blocks=128), warmup=False, **kwargs)
    return list(outputs.values())


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama):
    model, _ = tiny_llama
    prompt = [5, 6, 7, 8]
    alone = generate(model, [prompt], do_sample=True, temperature=1.0, seed=42)[0]
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=8, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=128))
    manager.start()
    others = [manager.add_request(p, do_sample=True, temperature=1.3, seed=i)
              for i, p in enumerate(random_prompts(5, 3, 20, seed=9))]
    seeded = manager.add_request(prompt, do_sample=True, temperature=1.0, seed=42)
    manager.add_request(prompt)                           # a greedy neighbour
    manager.stop()
    results = {}
    while (result := manager.get_result()) is not None:
        results[result.request_id] = result
    manager.destroy()
    assert results[seeded].generated_tokens == alone.generated_tokens
    assert len(results) == len(others) + 2
    different_seed = generate(model, [prompt], do_sample=True, temperature=1.0, seed=43)[0]
    assert different_seed.generated_tokens != alone.generated_tokens


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama):
    model, reference = tiny_llama
    prompt = [11, 12, 13]
    want = reference_greedy(reference, prompt, 8)
    assert generate(model, [prompt], do_sample=True, temperature=1.5, top_k=1, seed=1)[0] \
        .generated_tokens == want
    assert generate(model, [prompt], do_sample=True, temperature=1.5, top_p=1e-6, seed=1)[0] \
        .generated_tokens == want
    assert generate(model, [prompt], do_sample=True, temperature=1.5, min_p=1.0, seed=1)[0] \
        .generated_tokens == want


def test_high_temperature_sampling_differs_from_greedy(tiny_llama):
    model, reference = tiny_llama
    prompt = [11, 12, 13]
    sampled = generate(model, [prompt] * 4, max_new_tokens=12, do_sample=True, temperature=2.0)
    assert any(o.generated_tokens != reference_greedy(reference, prompt, 12) for o in sampled)


def test_logprobs_match_the_reference_distribution(tiny_llama):
    model, reference = tiny_llama
    prompt = [20, 21, 22, 23]
    output = generate(model, [prompt], max_new_tokens=4,
                      config=ContinuousBatchingConfig(page_size=4, num_blocks=64,
                                                      return_logprobs=True))[0]
    tokens = prompt + output.generated_tokens
    with torch.inference_mode():
        logits = reference(torch.tensor([tokens])).logits[0]
    want = [torch.log_softmax(logits[len(prompt) - 1 + i], -1)[t].item()
            for i, t in enumerate(output.generated_tokens)]
    assert output.logprobs == pytest.approx(want, abs=1e-4)


def test_top_logprobs_per_request(tiny_llama):
    model, _ = tiny_llama
    output = generate(model, [[30, 31]], max_new_tokens=3, logprobs=True, top_logprobs=3)[0]
    assert len(output.top_logprobs) == 3
    for chosen, top in zip(output.generated_tokens, output.top_logprobs):
        assert len(top) == 3 and top[0][0] == chosen        # greedy: the best is chosen
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_logit_bias_forces_a_token(tiny_llama):
    model, _ = tiny_llama
    output = generate(model, [[30, 31]], max_new_tokens=4, logit_bias={77: 100.0})[0]
    assert output.generated_tokens == [77, 77, 77, 77]
    penalised = generate(model, [[30, 31]], max_new_tokens=4, logit_bias={77: 100.0},
                         frequency_penalty=2.0, presence_penalty=2.0)[0]
    assert penalised.generated_tokens == [77, 77, 77, 77]    # bias 100 outweighs penalties
    repeated = generate(model, [[30, 31]], max_new_tokens=6, repetition_penalty=1e6)[0]
    assert len(set(repeated.generated_tokens)) == 6           # nothing repeats


def test_unsupported_processors_are_dropped_with_a_warning_or_refused(tiny_llama, caplog):
    """A transformers GenerationConfig asking for processors continuous batching does
    not run (no_repeat_ngram_size, beams): dropped with a warning naming them by
    default (drop_unsupported_processors), refused with a ValueError without it."""
    from transformers import GenerationConfig as TransformersGenerationConfig

    model, reference = tiny_llama
    asking = TransformersGenerationConfig(max_new_tokens=4, do_sample=False,
                                          no_repeat_ngram_size=2, num_beams=2)
    with caplog.at_level("WARNING", logger="engine.model_api"):
        outputs = model.generate_batch([[30, 31]], asking,
                                       ContinuousBatchingConfig(page_size=4, num_blocks=32),
                                       warmup=False)
    assert "no_repeat_ngram_size=2" in caplog.text and "num_beams=2" in caplog.text
    assert list(outputs.values())[0].generated_tokens == reference_greedy(reference, [30, 31], 4)
    with pytest.raises(ValueError, match="no_repeat_ngram_size=2"):
        model.generate_batch([[30, 31]], asking, ContinuousBatchingConfig(
            page_size=4, num_blocks=32, drop_unsupported_processors=False), warmup=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.model_api"):
        model.generate_batch([[30, 31]], TransformersGenerationConfig(max_new_tokens=2),
                             ContinuousBatchingConfig(page_size=4, num_blocks=32), warmup=False)
    assert "not supported" not in caplog.text


def test_vectorised_bias_equals_a_loop_over_entries():
    """Penalties, then the bias: the one index_add gives the logits a per-token loop
    over every request's entries gives, bit for bit (full-vocabulary biases too)."""
    from engine.generation_config import SamplingParams
    from engine.core.requests import RequestState
    from engine.step.sampling import Sampler

    vocab = 300
    generator = torch.Generator().manual_seed(4)
    full = {t: float(v) for t, v in enumerate(torch.randn(vocab, generator=generator))}
    params = [SamplingParams(logit_bias=full), SamplingParams(),
              SamplingParams(logit_bias={3: 100.0, 299: -7.5}, repetition_penalty=1.3,
                             presence_penalty=0.5),
              SamplingParams(repetition_penalty=0.8)]
    requests = [RequestState(f"r{i}", [1, 3, 5], 8, (), sampling=p, generated_tokens=[3, 7])
                for i, p in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    for request in requests:
        sampler.init_request(request)
    logits = torch.randn(len(requests), vocab, generator=generator)
    got = Sampler._apply_penalties_and_bias(logits, requests)
    expected = logits.clone()
    for row, request in zip(expected, requests):
        p = request.sampling
        if p.repetition_penalty != 1.0:
            for token in sorted(set(request.prompt_ids + request.generated_tokens)):
                value = row[token]
                row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(request.generated_tokens):
            row[token] -= request.generated_tokens.count(token) * p.frequency_penalty \
                + p.presence_penalty
        for token, bias in p.logit_bias.items():
            row[token] += bias
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)

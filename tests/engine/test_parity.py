"""Parity with transformers: logits and greedy generations of our model code on the
paged cache, for every family, under chunked prefill and preemption, on every kernel
ISA level this host can run."""

import pytest
import torch

from engine import load_model

from tests.helpers import (TINY_FAMILIES, cpu_isa, generate_and_inspect, random_prompts,
                           reference_greedy, runnable_isa_levels)

NEW_TOKENS = 10


@pytest.fixture(scope="module", params=runnable_isa_levels())
def loaded(tiny_models, request):
    """The models on each kernel ISA level this host runs (generic C, AVX2, the CPU's
    best): the level stays selected while that level's tests run."""
    with cpu_isa(request.param):
        yield {family: (load_model(path, progress=False), reference)
               for family, (path, reference) in tiny_models.items()}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(18, 1, 40, seed=7)


@pytest.fixture(scope="module")
def expected(loaded, prompts):
    return {family: [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
            for family, (_, reference) in loaded.items()}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logits_match_transformers(loaded, family):
    model, reference = loaded[family]
    ids = random_prompts(1, 37, 37, seed=3)[0]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    got = model.prompt_logits(ids, page_size=4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def run_batch(model, prompts, **config):
    return generate_and_inspect(model, prompts, NEW_TOKENS, warmup=True, **config)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("config", [
    {},
    {"page_size": 4, "max_batch_tokens": 16},
    {"page_size": 4, "max_batch_tokens": 16, "scheduler_type": "prefill_first"},
], ids=["default", "chunked", "chunked-prefill-first"])
def test_greedy_batch_matches_transformers(loaded, expected, prompts, family, config):
    model, _ = loaded[family]
    generated, stats = run_batch(model, prompts, **config)
    assert generated == expected[family]
    if config.get("max_batch_tokens") == 16:
        assert stats["num_steps"] > NEW_TOKENS + max(len(p) for p in prompts) // 16


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_batch_with_preemption_matches_transformers(loaded, expected, prompts, family):
    model, _ = loaded[family]
    # 14 blocks of 4 tokens: one 50-token request fits, the whole batch never does
    generated, stats = run_batch(model, prompts, page_size=4, max_batch_tokens=32, num_blocks=14)
    assert stats["num_preemptions"] > 0
    assert generated == expected[family]

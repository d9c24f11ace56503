"""Sliding-window models: tiny random Gemma 3 (hybrid sliding/full layers) and Mistral
(all layers sliding) match transformers with prompts longer than the window, and the
sliding layers' pool recycles pages that fell out of the window."""

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig

from tests.helpers import generate_and_inspect, random_prompts, reference_greedy


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_mistral"])
def test_logits_match_beyond_the_window(request, name):
    model, reference = request.getfixturevalue(name)
    ids = random_prompts(1, 30, 30, seed=31)[0]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.prompt_logits(ids, page_size=4), want, atol=1e-5, rtol=1e-4)


def run(model, prompts, **config):
    return generate_and_inspect(model, prompts, 12, page_size=4, **config)


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_mistral"])
@pytest.mark.parametrize("config", [
    {}, {"max_batch_tokens": 8}, {"max_batch_tokens": 32, "num_blocks": 14},
], ids=["default", "chunked", "preempted"])
def test_greedy_matches_transformers(request, name, config):
    model, reference = request.getfixturevalue(name)
    prompts = random_prompts(8, 1, 30, seed=32)
    generated, stats = run(model, prompts, **config)
    assert generated == [reference_greedy(reference, p, 12) for p in prompts]
    assert stats["prefix_cache_queries"] == 0            # prefix caching is off here
    if "num_blocks" in config:
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_mistral"])
def test_sliding_pool_recycles_pages_out_of_the_window(request, name):
    model, reference = request.getfixturevalue(name)
    prompt = random_prompts(1, 20, 20, seed=33)[0]
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=60, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=8))
    manager.start()
    request_id = manager.add_request(prompt, streaming=True)
    most_sliding_used, most_full_used = 0, 0
    for output in manager.request_id_iter(request_id):
        stats = manager.stats()
        most_sliding_used = max(most_sliding_used,
                                stats["num_sliding_blocks"] - stats["num_free_sliding_blocks"])
        most_full_used = max(most_full_used, stats["num_blocks"] - stats["num_free_blocks"])
    assert output.generated_tokens == reference_greedy(reference, prompt, 60)
    # the window (7 keys) plus a chunk of 8 spans at most 5 pages of 4; the full
    # blocks count all 80 positions (20 pages; for Mistral they hold no memory)
    assert most_sliding_used <= 5
    assert most_full_used == 20
    cache_rows = [layer.shape[0] for layer in manager.loop.runner.cache.key_caches]
    sliding = model.module.layer_is_sliding
    assert cache_rows == [stats["num_sliding_blocks"] if s else stats["num_blocks"]
                          for s in sliding]
    manager.stop()
    manager.check_invariants()
    stats = manager.stats()
    assert stats["num_free_sliding_blocks"] == stats["num_sliding_blocks"]
    manager.destroy()

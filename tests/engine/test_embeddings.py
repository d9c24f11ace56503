"""Embedding requests (engine/pooling.py, pooling_step.py): prefill-only work in the
engine's batches, pooled last-token / mean / first-token hidden states equal to
transformers' `last_hidden_state` pooled the same way, through chunked prefill and
beside generating requests, which keep their tokens."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, Pooling
from tests.helpers import random_prompts


def reference(model, prompt: list[int], pooling: Pooling) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double()
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling.kind]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def run(model, prompts, poolings, generate=(), new_tokens=12, **config):
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=new_tokens, eos_token_id=[]),
        ContinuousBatchingConfig(**config))
    manager.start()
    try:
        ids = [manager.add_request(p, pooling=pool) for p, pool in zip(prompts, poolings)]
        generating = [manager.add_request(p, max_new_tokens=new_tokens) for p in generate]
        results = {}
        while len(results) < len(ids) + len(generating):
            result = manager.get_result(timeout=60)
            results[result.request_id] = result
        manager.check_invariants()
        stats = manager.stats()
    finally:
        manager.stop()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return [results[i] for i in ids], [results[i] for i in generating], stats


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_states_match_transformers_through_chunks(tiny_models, kind):
    from engine import load_model

    path, reference_model = tiny_models["qwen2"]
    model = load_model(path, progress=False)
    prompts = random_prompts(5, 3, 70, seed=11)
    poolings = [Pooling(kind, normalize=i % 2 == 0) for i in range(len(prompts))]
    generate = random_prompts(2, 4, 20, seed=12)
    plain = [o.generated_tokens for o in model.generate_batch(
        generate, GenerationConfig(max_new_tokens=12, eos_token_id=[]),
        ContinuousBatchingConfig()).values()]
    embedded, generated, _ = run(model, prompts, poolings, generate, max_batch_tokens=32)
    for prompt, pooling, output in zip(prompts, poolings, embedded):
        assert output.generated_tokens == [] and output.finish_reason == "stop"
        got = torch.tensor(output.embedding, dtype=torch.float64)
        want = reference(reference_model, prompt, pooling)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9999
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-3)
    assert [o.generated_tokens for o in generated] == plain


def test_prefix_hits_and_preemption_keep_the_vectors(tiny_models):
    """Repeated prompts (mean pooling never takes cached rows; last-token pooling
    may) in a cache so small that requests are preempted and recomputed."""
    from engine import load_model

    path, reference_model = tiny_models["llama"]
    model = load_model(path, progress=False)
    shared = random_prompts(1, 40, 41, seed=13)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 30, seed=14)] * 2
    poolings = [Pooling("mean" if i % 2 else "last") for i in range(len(prompts))]
    embedded, _, stats = run(model, prompts, poolings,
                             generate=random_prompts(4, 10, 20, seed=15), new_tokens=120,
                             page_size=16, num_blocks=20, max_batch_tokens=16)
    for prompt, pooling, output in zip(prompts, poolings, embedded):
        got = torch.tensor(output.embedding, dtype=torch.float64)
        assert torch.allclose(got, reference(reference_model, prompt, pooling), atol=1e-4)


def test_a_preempted_embedding_request_starts_its_sum_again():
    """Recomputed from its first token, a mean-pooled request must not add its first
    chunks twice: preemption drops the running sum (unless its K/V went to the CPU
    pool, where the sum stays valid)."""
    from engine.kv_cache.allocator import BlockAllocator
    from engine.core.scheduler import Scheduler
    from tests.engine.test_scheduler import make_request

    scheduler = Scheduler(BlockAllocator(8), 4, 8, 4, 0.0, "fifo")
    request = make_request("a", 20)
    request.pooling, request.pooled = Pooling("mean"), torch.ones(3)
    scheduler.add(request)
    batch = scheduler.schedule()
    assert batch.entries[0].request is request and request.pooled is not None
    scheduler._preempt(request)
    assert request.pooled is None and request.num_computed_tokens == 0

"""Async batching (engine/core/async_steps.py) on the CPU, where it only reorders the host's
work: the same tokens as transformers and as ordinary steps, with requests stopping
on EOS inside a lookahead step, staggered lengths, and all blocks returned."""

from __future__ import annotations

import torch

from engine import ContinuousBatchingConfig
from engine.step.feature_gates import async_batching
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy


def test_async_batching_is_on_where_graphs_replay_decodes():
    auto, on = ContinuousBatchingConfig(), ContinuousBatchingConfig(use_async_batching=True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert async_batching(auto, "capture", cuda, False)
    assert not async_batching(auto, None, cuda, False)
    assert not async_batching(auto, "capture", cuda, True)     # tensor parallel
    assert async_batching(on, None, cpu, False)
    assert not async_batching(on, None, cpu, True)
    assert not async_batching(ContinuousBatchingConfig(use_async_batching=False), "capture",
                              cuda, False)


def test_lookahead_steps_give_transformers_tokens(tiny_llama):
    model, reference = tiny_llama
    prompts = random_prompts(6, 3, 40, seed=61)
    want = [reference_greedy(reference, p, 9) for p in prompts]
    tokens, stats = generate_and_inspect(model, prompts, 9, use_async_batching=True,
                                         max_batch_tokens=32)
    assert stats["async_batching"] == 1 and stats["num_lookahead_steps"] >= 6
    assert tokens == want


def test_eos_inside_a_lookahead_step_drops_the_wasted_row(tiny_llama):
    from engine import GenerationConfig

    model, reference = tiny_llama
    prompts = random_prompts(5, 5, 20, seed=62)
    full = [reference_greedy(reference, p, 12) for p in prompts]
    eos = full[0][4]         # the first request stops at its 5th token, others elsewhere
    want = [t[:t.index(eos) + 1] if eos in t else t for t in full]
    for use_async in (False, True):
        outputs = model.generate_batch(
            prompts, GenerationConfig(max_new_tokens=12, eos_token_id=[eos]),
            ContinuousBatchingConfig(use_async_batching=use_async), persistent_manager=True)
        manager = model.kept_manager
        manager.check_invariants()
        stats = manager.stats()
        manager.destroy()
        assert [o.generated_tokens for o in outputs.values()] == want
        assert stats["num_free_blocks"] == stats["num_blocks"]
        assert (stats["num_lookahead_steps"] > 5) == use_async

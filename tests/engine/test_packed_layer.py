"""The packed-layer path (engine/models/packed_layer.py) computes exactly what the
layer's modules compute: the same final hidden states and the same cache contents,
bit for bit, for decode steps and mixed prefill steps; for the default model in
bf16-weights (fused GGUF MLP) and tiny models in float32 and bf16-weights (MLP
modules). Steps for the block kernels are left to them."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.generation_config import SamplingParams
from engine.kv_cache.sizing import CacheSizing
from engine.models.block_weights import BF16_KERNEL_ROWS
from engine.models.executors import Executors
from engine.models.fast_decode import FastDecodeLayer
from engine.models.packed_layer import PackedLayer
from engine.core.requests import RequestState
from engine.step.runner import ModelRunner
from engine.core.scheduler import ScheduledBatch, ScheduledRequest
from tests.helpers import (ServedSpy, executors_set_to, layer_executors, needs_bf16_gemm,
                           needs_bf16_packing)

PAGE = 16
NUM_BLOCKS = 8 * 72
"""Room for 72 requests of 8 blocks, or 192 of 3 (past every build's kernel rows)."""


def _batch(vocab: int, shapes: list[tuple[int, int]]) -> ScheduledBatch:
    """Requests feeding positions start..end-1 (shapes: (start, end)), each on the
    blocks its `end` tokens need, one run of blocks after another."""
    generator = torch.Generator().manual_seed(len(shapes))
    entries, next_block = [], 0
    for index, (start, end) in enumerate(shapes):
        prompt = torch.randint(3, vocab, (end,), generator=generator).tolist()
        request = RequestState(f"r{index}", prompt, 4, (), SamplingParams())
        needed = -(-end // PAGE)
        request.block_ids = list(range(next_block, next_block + needed))
        next_block += needed
        entries.append(ScheduledRequest(request, start, end - start, True))
    assert next_block <= NUM_BLOCKS, "a batch larger than the test cache"
    return ScheduledBatch(entries, [])


class StepRuns:
    """One step's inputs on a fresh runner whose caches restart from the same random
    contents on every `run`: the final hidden states and the caches after it."""

    def __init__(self, model, batch: ScheduledBatch, seed: int = 1, cache_dtype=None) -> None:
        self.module = module = model.module
        with pytest.MonkeyPatch.context() as patch:   # the runner's cache in `cache_dtype`
            if cache_dtype is not None:
                patch.setattr(module, "kv_cache_dtype", cache_dtype)
            self.runner = ModelRunner(module, CacheSizing(NUM_BLOCKS, PAGE, 4096, 64, 0), seed=0)
        generator = torch.Generator().manual_seed(seed)
        self.caches = self.runner.cache.key_caches + self.runner.cache.value_caches
        for cache in self.caches:
            cache.copy_(torch.randn(cache.shape, generator=generator))
        self.start = [cache.clone() for cache in self.caches]
        self.inputs = self.runner._inputs(batch)

    def run(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for cache, initial in zip(self.caches, self.start):
            cache.copy_(initial)
        inputs = self.inputs
        with torch.inference_mode():
            hidden = self.module(inputs.input_ids, inputs.positions, self.runner.cache,
                                 inputs.meta, self.runner.backend)
        return hidden, [cache.clone() for cache in self.caches]


def run_both_ways(model, batch: ScheduledBatch):
    """The step's final hidden states and caches through the packed layers, then
    through the modules, from the same random cache contents; and how many layer
    calls the packed path served."""
    module, runs = model.module, StepRuns(model, batch)
    fast = layer_executors(module, FastDecodeLayer)
    spies = [ServedSpy(packed) for packed in layer_executors(module, PackedLayer)]
    with_packed = Executors(layers=tuple(
        tuple(e for e in pair if e is not None) for pair in zip(fast, spies)))
    without = Executors(layers=tuple(() if f is None else (f,) for f in fast))
    results = []
    for executors in (with_packed, without):        # no stacks: test_packed_stack.py
        with executors_set_to(module, executors):
            results.append(runs.run())
    return results, sum(sum(spy.served) for spy in spies)


def assert_identical(results) -> None:
    (packed, packed_caches), (modules, module_caches) = results
    assert torch.equal(packed, modules)
    assert all(torch.equal(a, b) for a, b in zip(packed_caches, module_caches))


@pytest.fixture(scope="module")
def default_bf16():
    return load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)


@needs_bf16_packing
@needs_bf16_gemm      # without it the blocks serve every step (test_bf16_weights_blocks.py)
def test_default_model_steps_are_bit_identical(default_bf16):
    vocab = default_bf16.config.vocab_size
    layers = len(default_bf16.module.layers)
    assert all(isinstance(e, PackedLayer) for e in layer_executors(default_bf16.module, PackedLayer))
    decodes = _batch(vocab, [(30 + i, 31 + i) for i in range(12)])
    results, served = run_both_ways(default_bf16, decodes)
    assert_identical(results)
    assert served == layers
    mixed = _batch(vocab, [(0, 40), (20, 52), (60, 61), (70, 71)])   # chunks and decodes
    results, served = run_both_ways(default_bf16, mixed)
    assert_identical(results)
    assert served == layers
    small = _batch(vocab, [(30 + i, 31 + i) for i in range(BF16_KERNEL_ROWS)])
    _, served = run_both_ways(default_bf16, small)          # the block kernels' steps
    assert served == 0


@pytest.mark.parametrize("dtype", ["float32", pytest.param(
    "bf16-weights", marks=[needs_bf16_packing, needs_bf16_gemm])])   # else refused at load
def test_tiny_model_steps_are_bit_identical(tiny_models, dtype):
    path, _ = tiny_models["llama"]
    model = load_model(path, dtype=dtype, progress=False)
    layers = len(model.module.layers)
    for shapes in ([(10, 11), (20, 21), (5, 6)], [(0, 33), (8, 20), (40, 41)], [(3, 4)]):
        results, served = run_both_ways(model, _batch(211, shapes))
        assert_identical(results)
        assert served == layers

"""The packed stack (engine/models/packed_stack.py, decoder_stack.c) computes exactly
what the packed layers' loop computes, bit for bit: final hidden states and cache
contents, for decode steps and steps with prefill chunks, over a bf16 and an fp32
cache; steps outside its range (the block kernels' few rows, prefills past the
native GEMM's rows) are left to the loop."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.kv_cache.sizing import CacheSizing
from engine.models.block_weights import BF16_KERNEL_ROWS
from engine.models.packed_linear import NATIVE_BF16_MAX_ROWS
from engine.models.packed_stack import PackedStack
from engine.runner import ModelRunner

from tests.engine.test_packed_layer import NUM_BLOCKS, PAGE, _batch


def run_stack_and_loop(model, batch, cache_dtype=None):
    """Final hidden states and caches through the stack, then through the layer loop,
    from the same random cache contents; and whether the stack served the step."""
    module = model.module
    saved_dtype = getattr(module, "kv_cache_dtype", None)
    if cache_dtype is not None:
        module.kv_cache_dtype = cache_dtype
    runner = ModelRunner(module, CacheSizing(NUM_BLOCKS, PAGE, 4096, 64, 0), seed=0)
    module.kv_cache_dtype = saved_dtype
    generator = torch.Generator().manual_seed(2)
    caches = runner.cache.key_caches + runner.cache.value_caches
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    start = [cache.clone() for cache in caches]
    inputs = runner._inputs(batch)
    stack, served, results = module.packed_stack, [], []
    try:
        for use_stack in (True, False):
            module.packed_stack = (lambda *args: served.append(stack(*args)) or served[-1]) \
                if use_stack else None
            for cache, initial in zip(caches, start):
                cache.copy_(initial)
            with torch.inference_mode():
                hidden = module(inputs.input_ids, inputs.positions, runner.cache, inputs.meta)
            results.append((hidden, [cache.clone() for cache in caches]))
    finally:
        module.packed_stack = stack
    (stacked, stacked_caches), (looped, looped_caches) = results
    identical = torch.equal(stacked, looped) and all(
        torch.equal(a, b) for a, b in zip(stacked_caches, looped_caches))
    return identical, served[0] is not None


@pytest.fixture(scope="module")
def default_bf16():
    return load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)


def test_the_default_model_has_a_stack(default_bf16):
    assert isinstance(default_bf16.module.packed_stack, PackedStack)


@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
def test_decode_and_mixed_steps_are_bit_identical(default_bf16, cache_dtype):
    vocab = default_bf16.config.vocab_size
    decodes = _batch(vocab, [(30 + i, 31 + i) for i in range(12)])
    mixed = _batch(vocab, [(0, 40), (20, 52), (60, 61), (70, 71)])   # chunks and decodes
    for batch in (decodes, mixed):
        identical, served = run_stack_and_loop(default_bf16, batch, cache_dtype)
        assert served and identical


def test_steps_outside_its_range_go_to_the_loop(default_bf16):
    vocab = default_bf16.config.vocab_size
    small = _batch(vocab, [(30 + i, 31 + i) for i in range(BF16_KERNEL_ROWS)])
    large = _batch(vocab, [(0, NATIVE_BF16_MAX_ROWS // 2 + 8), (0, NATIVE_BF16_MAX_ROWS // 2)])
    for batch in (small, large):
        identical, served = run_stack_and_loop(default_bf16, batch)
        assert identical and not served

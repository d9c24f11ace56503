"""The whole-stack paths compute exactly what the layer loop computes, bit for bit:
final hidden states and cache contents. PackedStack (packed_stack.py,
decoder_stack.c) against the packed layers, for decode steps and steps with prefill
chunks, over a bf16 and an fp32 cache; FastDecodeStack (fast_decode.py,
decode_layer.c) against the fast decode layers, in bf16-weights and float32. Steps
outside a stack's range are left to the next path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import load_model
from engine.models.block_weights import BF16_KERNEL_ROWS, PANEL_KERNEL_ROWS
from engine.models.fast_decode import FastDecodeStack
from engine.models import packed_linear
from engine.models.packed_linear import NATIVE_BF16_MAX_ROWS
from engine.models.packed_stack import PackedStack

from tests.engine.test_packed_layer import StepRuns, _batch
from tests.helpers import (ServedSpy, block_kernel_rows, executors_set_to, needs_bf16_gemm,
                           stack_of)


def run_stack_and_loop(model, stack_type, batch, cache_dtype=None):
    """Final hidden states and caches with only the model's `stack_type` stack, then
    with none (the layer loop), from the same random cache contents; returns whether
    they are identical and whether the stack served the step."""
    module, runs = model.module, StepRuns(model, batch, seed=2, cache_dtype=cache_dtype)
    spy, results = ServedSpy(stack_of(module, stack_type)), []
    for stacks in ((spy,), ()):
        with executors_set_to(module, replace(module.executors, stacks=stacks)):
            results.append(runs.run())
    (stacked, stacked_caches), (looped, looped_caches) = results
    identical = torch.equal(stacked, looped) and all(
        torch.equal(a, b) for a, b in zip(stacked_caches, looped_caches))
    return identical, spy.served[0]


UNBOUNDED_ROWS = 1 << 20
"""A max_rows past this means "any size" (BlockLinear without a dense copy)."""


def assert_fast_stack_serves_its_rows(model) -> None:
    """The model's FastDecodeStack equals its fast layers bit for bit on decode steps
    of 1, 3 (when it takes 3) and max_rows rows, and leaves a step of max_rows + 1 and a
    prefill to them. Blocks without dense copies serve decode steps of any size: there
    a step past the panels' crossover stands in for max_rows."""
    stack = stack_of(model.module, FastDecodeStack)
    unbounded = stack.max_rows > UNBOUNDED_ROWS
    largest = PANEL_KERNEL_ROWS + 3 if unbounded else stack.max_rows
    for rows in sorted({1, min(3, largest), largest}):
        identical, served = run_stack_and_loop(model, FastDecodeStack, decodes(model, rows))
        assert served and identical, rows
    refused = [_batch(model.config.vocab_size, [(0, 5)])] + (
        [] if unbounded else [decodes(model, stack.max_rows + 1)])
    for batch in refused:
        identical, served = run_stack_and_loop(model, FastDecodeStack, batch)
        assert identical and not served


@pytest.fixture(scope="module")
def default_bf16():
    return load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)


def decodes(model, count: int):
    """`count` decode rows after contexts of 30 to 45 tokens (3 blocks each)."""
    return _batch(model.config.vocab_size, [(30 + i % 16, 31 + i % 16) for i in range(count)])


@needs_bf16_gemm
def test_the_default_model_has_both_stacks(default_bf16):
    assert [type(s) for s in default_bf16.module.executors.stacks] == [FastDecodeStack, PackedStack]


@needs_bf16_gemm
@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
def test_packed_stack_decode_and_mixed_steps_are_bit_identical(default_bf16, cache_dtype):
    mixed = _batch(default_bf16.config.vocab_size, [(0, 40), (20, 52), (60, 61), (70, 71)])
    for batch in (decodes(default_bf16, 12), mixed):
        identical, served = run_stack_and_loop(default_bf16, PackedStack, batch, cache_dtype)
        assert served and identical


@needs_bf16_gemm
def test_packed_stack_leaves_block_kernel_steps_to_the_loop(default_bf16):
    identical, served = run_stack_and_loop(default_bf16, PackedStack,
                                           decodes(default_bf16, BF16_KERNEL_ROWS))
    assert identical and not served


@needs_bf16_gemm
def test_packed_stack_keeps_the_native_gemm_past_its_row_limit(default_bf16, monkeypatch):
    """Past NATIVE_BF16_MAX_ROWS the loop multiplies on oneDNN (where oneDNN packs bf16)
    and the stack stays on the native GEMM: it then equals the loop whose products are
    all native."""
    vocab = default_bf16.config.vocab_size
    large = _batch(vocab, [(0, NATIVE_BF16_MAX_ROWS // 2 + 8), (20, 20 + NATIVE_BF16_MAX_ROWS // 2),
                           (50, 51)])
    identical, served = run_stack_and_loop(default_bf16, PackedStack, large)
    onednn = default_bf16.module.layers[0].self_attn.o_proj.packed.onednn is not None
    assert served and identical != onednn    # the loop's oneDNN products round differently
    monkeypatch.setattr(packed_linear, "NATIVE_BF16_MAX_ROWS", 1 << 20)
    identical, served = run_stack_and_loop(default_bf16, PackedStack, large)
    assert served and identical


@needs_bf16_gemm      # without it the blocks serve every step (test_bf16_weights_blocks.py)
def test_fast_decode_stack_is_bit_identical(default_bf16):
    for rows in range(1, BF16_KERNEL_ROWS + 1):
        identical, served = run_stack_and_loop(default_bf16, FastDecodeStack,
                                               decodes(default_bf16, rows))
        assert served and identical
    for batch in (decodes(default_bf16, BF16_KERNEL_ROWS + 1),
                  _batch(default_bf16.config.vocab_size, [(0, 5)])):     # a prefill
        identical, served = run_stack_and_loop(default_bf16, FastDecodeStack, batch)
        assert identical and not served


def test_fast_decode_stack_in_float32():
    model = load_model("smollm2-135m-instruct", progress=False)
    assert [type(s) for s in model.module.executors.stacks] == [FastDecodeStack]
    for rows, cache_dtype in ((1, None), (block_kernel_rows(), torch.bfloat16)):
        identical, served = run_stack_and_loop(model, FastDecodeStack, decodes(model, rows),
                                               cache_dtype)
        assert served and identical


def test_each_cache_keeps_its_own_pointers(default_bf16):
    """Two runners (two caches) alternating on one model: each step writes and reads
    its own cache, as if it ran alone."""
    first = StepRuns(default_bf16, decodes(default_bf16, 8), seed=3)
    alone = first.run()
    second = StepRuns(default_bf16, decodes(default_bf16, 8), seed=4)
    second_result = second.run()
    again = first.run()
    assert torch.equal(alone[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(alone[1], again[1]))
    assert not torch.equal(alone[0], second_result[0])


@pytest.mark.parametrize("field", ["slot_mapping", "decode_kv_slots"])
@pytest.mark.parametrize("stack_type,rows", [
    (FastDecodeStack, 2), pytest.param(PackedStack, 12, marks=needs_bf16_gemm)])
def test_the_stacks_refuse_slots_outside_the_cache(default_bf16, stack_type, rows, field):
    """A step whose metadata names a slot past the caches (a new K/V's slot, or one a
    row reads) stops with an IndexError before the native stack writes or reads
    there."""
    runs = StepRuns(default_bf16, decodes(default_bf16, rows))
    keys = runs.caches[0]                                   # [num_blocks, page, KVH, D]
    getattr(runs.inputs.meta, field).view(-1)[1] = keys.shape[0] * keys.shape[1]
    module = default_bf16.module
    spy = ServedSpy(stack_of(module, stack_type))  # the stack itself refuses, not a later path
    with executors_set_to(module, replace(module.executors, stacks=(spy,))):
        with pytest.raises(IndexError, match="outside the KV cache"):
            runs.run()
    assert [type(error) for error in spy.raised] == [IndexError]
    if field == "slot_mapping":      # refused before the first layer stored its K/V
        assert all(torch.equal(cache, start) for cache, start in zip(runs.caches, runs.start))

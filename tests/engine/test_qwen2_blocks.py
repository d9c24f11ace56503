"""A Qwen2 GGUF model (a bias on q, k and v) decodes on its blocks through the fast
decode layers and their whole-stack call (models/fast_decode.py, decode_layer.c),
the bias added after the qkv kernel as BlockLinear adds it.

The model is the default one's GGUF copied as Qwen2 with random biases
(tests/gguf_copies.py's write_as_qwen2): the same Q4_1 blocks, q and k rows in the
order Qwen2 files keep them.
"""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.models.fast_decode import FastDecodeLayer, FastDecodeStack
from tests.engine.test_packed_layer import StepRuns, _batch
from tests.engine.test_packed_stack import decodes, run_stack_and_loop
from tests.gguf_copies import write_as_qwen2
from tests.helpers import assert_blocks_decode_like_dense


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    from engine.loading import resolve_embedded

    path = tmp_path_factory.mktemp("qwen2") / "smollm2-as-qwen2.gguf"
    assert write_as_qwen2(resolve_embedded("smollm2-135m-instruct"), path) == 3 * 30
    return path


@pytest.fixture(scope="module")
def qwen2(qwen2_path):
    return load_model(str(qwen2_path), progress=False)


def test_every_qwen2_layer_with_its_bias_is_on_the_stack(qwen2):
    assert qwen2.config.model_type == "qwen2"
    assert [type(s) for s in qwen2.module.layer_stacks] == [FastDecodeStack]
    layers = qwen2.module.layers
    assert all(isinstance(layer.fast_decode, FastDecodeLayer) for layer in layers)
    bias = layers[0].self_attn.qkv_proj.bias
    assert bias is not None and bias.shape == (576 + 2 * 192,) and bias.abs().min() > 0


def test_the_qwen2_stack_is_bit_identical_to_its_fast_layers(qwen2):
    stack = qwen2.module.layer_stacks[0]
    for rows in (1, 3, stack.max_rows):
        identical, served = run_stack_and_loop(qwen2, FastDecodeStack, decodes(qwen2, rows))
        assert served and identical, rows
    for batch in (decodes(qwen2, stack.max_rows + 1), _batch(qwen2.config.vocab_size, [(0, 5)])):
        identical, served = run_stack_and_loop(qwen2, FastDecodeStack, batch)
        assert identical and not served


def test_a_qwen2_fast_layer_adds_the_bias_as_the_modules_do(qwen2):
    """One decode step through the fast layers against the same layers' modules (the
    blocks both ways: only the fused path differs)."""
    module, stacks = qwen2.module, qwen2.module.layer_stacks
    fast = [layer.fast_decode for layer in module.layers]
    runs, results = StepRuns(qwen2, decodes(qwen2, 3), seed=4), []
    module.layer_stacks = []
    try:
        for use_fast in (True, False):
            for layer, path in zip(module.layers, fast):
                layer.fast_decode = path if use_fast else None
            results.append(runs.run())
    finally:
        module.layer_stacks = stacks
        for layer, path in zip(module.layers, fast):
            layer.fast_decode = path
    (fused, _), (modules, _) = results
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_qwen2_gguf_model_decodes_like_the_dense_path(qwen2, qwen2_path):
    dense = load_model(str(qwen2_path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(qwen2, dense, max_new_tokens=16)

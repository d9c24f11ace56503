"""Qwen2 and Qwen3 GGUF models decode on their blocks through the fast decode layers
and their whole-stack call (models/fast_decode.py, decode_layer.c): Qwen2's bias on
q, k and v added after the qkv kernel as BlockLinear adds it, Qwen3's RMSNorm of
every q and k head after that.

The Qwen2 model is the default one's GGUF copied as Qwen2 with random biases
(tests/gguf_copies.py's write_as_qwen2: the same Q4_1 blocks, q and k rows in the
order Qwen2 files keep them); the Qwen3 one a tiny random model in Q4_1
(write_tiny_qwen3: heads of 128, the q projection twice the hidden size wide).
"""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.models.fast_decode import FastDecodeLayer, FastDecodeStack
from tests.engine.test_packed_layer import StepRuns
from tests.engine.test_packed_stack import assert_fast_stack_serves_its_rows, decodes
from tests.gguf_copies import write_as_qwen2, write_tiny_qwen3
from tests.helpers import assert_blocks_decode_like_dense


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_path(request, tmp_path_factory):
    from engine.loading import resolve_embedded

    source = resolve_embedded("smollm2-135m-instruct")
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    if request.param == "qwen2":
        assert write_as_qwen2(source, path) == 3 * 30
    else:
        write_tiny_qwen3(source, path)
    return path


@pytest.fixture(scope="module")
def qwen(qwen_path):
    return load_model(str(qwen_path), progress=False)


def test_every_qwen_layer_is_on_the_stack(qwen):
    layers, attn = qwen.module.layers, qwen.module.layers[0].self_attn
    assert [type(s) for s in qwen.module.layer_stacks] == [FastDecodeStack]
    assert all(isinstance(layer.fast_decode, FastDecodeLayer) for layer in layers)
    width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    if qwen.config.model_type == "qwen2":
        bias = attn.qkv_proj.bias
        assert bias is not None and bias.shape == (width,) and bias.abs().min() > 0
    else:
        assert qwen.config.model_type == "qwen3" and attn.head_dim == 128
        assert attn.q_norm is not None and attn.k_norm is not None and attn.qkv_proj.bias is None
        assert layers[0].fast_decode.head_norms == (attn.q_norm, attn.k_norm)


def test_the_qwen_stack_is_bit_identical_to_its_fast_layers(qwen):
    assert_fast_stack_serves_its_rows(qwen)


def test_a_qwen_fast_layer_computes_what_its_modules_do(qwen):
    """One decode step through the fast layers against the same layers' modules (the
    blocks both ways: only the fused path differs; Qwen3's head norms sum in another
    order there)."""
    module, stacks = qwen.module, qwen.module.layer_stacks
    fast = [layer.fast_decode for layer in module.layers]
    runs, results = StepRuns(qwen, decodes(qwen, 3), seed=4), []
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
    (fused, fused_caches), (modules, module_caches) = results
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(fused_caches, module_caches):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_qwen_gguf_model_decodes_like_the_dense_path(qwen, qwen_path):
    dense = load_model(str(qwen_path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(qwen, dense, max_new_tokens=16)

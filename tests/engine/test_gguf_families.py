"""Qwen2, Qwen3 and Gemma 3 GGUF models decode on their blocks through the fast decode
layers and their whole-stack call (models/fast_decode.py, decode_layer.c): Qwen2's
bias on q, k and v added after the qkv kernel as BlockLinear adds it, Qwen3's RMSNorm
of every q and k head after that; Gemma 3's head norms too, its norms on the
attention's and the MLP's outputs, its (1 + weight) norms, GELU-tanh, and its
sliding layers over their windows with their own rotary tables.

The Qwen2 model is the default one's GGUF copied as Qwen2 with random biases
(tests/gguf_copies.py's write_as_qwen2: the same Q4_1 blocks, q and k rows in the
order Qwen2 files keep them); the Qwen3 one a tiny random model in Q4_1
(write_tiny_qwen3: heads of 128, the q projection twice the hidden size wide); the
Gemma 3 one a tiny random model in Q4_1 with Gemma 3's tokenizer (write_tiny_gemma3:
five sliding layers of an 8-token window, then a full one; the steps' contexts of
30-45 tokens reach past the window).
"""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.kernels.native import GATED_ACTIVATIONS
from engine.models.executors import Executors
from engine.models.fast_decode import FastDecodeLayer, FastDecodeStack
from engine.models.layer_spec import FULL, SLIDING
from engine.models.packed_stack import PackedStack
from tests.engine.test_packed_layer import StepRuns
from tests.engine.test_packed_stack import assert_fast_stack_serves_its_rows, decodes
from tests.gguf_copies import write_as_qwen2, write_tiny_gemma3, write_tiny_qwen3
from tests.helpers import (assert_blocks_decode_like_dense, executors_set_to, layer_executors,
                           needs_bf16_gemm)


def write_family(name: str, path) -> None:
    from engine.loading.model_files import gguf_source, resolve_embedded

    if name == "gemma3":
        write_tiny_gemma3(gguf_source("gemma3-270m", None), path)
    elif name == "qwen2":
        assert write_as_qwen2(resolve_embedded("smollm2-135m-instruct"), path) == 3 * 30
    else:
        write_tiny_qwen3(resolve_embedded("smollm2-135m-instruct"), path)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "gemma3"])
def family_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_family(request.param, path)
    return path


@pytest.fixture(scope="module")
def family(family_path):
    return load_model(str(family_path), progress=False)


def test_every_layer_is_on_the_stack(family):
    layers, attn = family.module.layers, family.module.layers[0].self_attn
    assert [type(s) for s in family.module.executors.stacks] == [FastDecodeStack]
    fast = layer_executors(family.module, FastDecodeLayer)
    assert all(isinstance(executor, FastDecodeLayer) for executor in fast)
    width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    model_type, entry = family.config.model_type, fast[0].entry.traits
    if model_type == "qwen2":
        bias = attn.qkv_proj.bias
        assert bias is not None and bias.shape == (width,) and bias.abs().min() > 0
        assert entry.qkv_bias == bias.data_ptr() and not entry.q_norm
    elif model_type == "qwen3":
        assert attn.head_dim == 128 and attn.qkv_proj.bias is None
        assert entry.q_norm == attn.q_norm.weight.data_ptr()
        assert entry.k_norm == attn.k_norm.weight.data_ptr()
        assert entry.q_norm and entry.k_norm and not entry.attn_out_norm
    else:
        assert model_type == "gemma3_text" and family.module.sliding_window == 8
        stack = family.module.executors.stacks[0]
        assert stack.groups == [FULL, SLIDING]
        assert [executor.group for executor in fast] == [SLIDING] * 5 + [FULL]
        assert stack.shape.activation == GATED_ACTIVATIONS["gelu_tanh"]
        assert entry.q_norm and entry.attn_out_norm and entry.mlp_out_norm
        # the (1 + weight) norms reach C with the 1 added
        norm = layers[0].post_attention_layernorm
        scaled = next(t for t in fast[0].traits.kept if t.data_ptr() == entry.attn_out_norm)
        torch.testing.assert_close(scaled, norm.weight + 1)


def test_the_stack_is_bit_identical_to_its_fast_layers(family):
    assert_fast_stack_serves_its_rows(family)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_fast_layer_computes_what_its_modules_do(family, rows):
    """One decode step through the fast layers against the same layers' modules (the
    blocks both ways: only the fused path differs; Qwen3's and Gemma 3's norms and
    Gemma 3's GELU are C there, torch's ops in the modules)."""
    module = family.module
    runs, results = StepRuns(family, decodes(family, rows), seed=4), []
    for executors in (module.executors.without_stacks(), Executors()):
        with executors_set_to(module, executors):
            results.append(runs.run())
    (fused, fused_caches), (modules, module_caches) = results
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(fused_caches, module_caches):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@needs_bf16_gemm
def test_gemma3_in_bf16_weights_keeps_short_steps_on_the_blocks(tmp_path):
    """bf16-weights: steps of up to the block kernels' rows take the fast decode
    stack (fp32 blocks), larger ones the bf16 stack."""
    write_family("gemma3", tmp_path / "gemma3.gguf")
    model = load_model(str(tmp_path / "gemma3.gguf"), dtype="bf16-weights", progress=False)
    fast, packed = model.module.executors.stacks
    assert isinstance(fast, FastDecodeStack) and isinstance(packed, PackedStack)
    assert packed.block_rows == fast.max_rows
    assert_fast_stack_serves_its_rows(model)


@pytest.mark.slow
def test_a_gguf_model_decodes_like_the_dense_path(family, family_path):
    dense = load_model(str(family_path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(family, dense, max_new_tokens=16)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_files_weights_are_read_as_transformers_reads_them(name, tmp_path):
    """models/gguf_checkpoint.py reads the file in place: every parameter equals,
    bit for bit, what transformers' own GGUF loader makes of the same file (q and k
    rows un-permuted for Llama, Gemma's norms less one), and the blocks dequantize
    to the dense values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loading.model_files import resolve_embedded
    from engine.models.gguf_checkpoint import read_gguf_checkpoint

    path = resolve_embedded("smollm2-135m-instruct") if name == "llama" else tmp_path / "m.gguf"
    if name != "llama":
        write_family(name, path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).state_dict()
    checkpoint = read_gguf_checkpoint(path, config)
    ours = checkpoint.dense_state()                  # the blocks dequantized, the rest as read
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert sorted(ours) == sorted(theirs)
    unequal = [k for k, v in theirs.items() if not torch.equal(ours[k], v)]
    assert not unequal, unequal[:4]
    blocks = checkpoint.blocks
    assert any(".q_proj." in k for k in blocks) and any(".down_proj." in k for k in blocks)
    assert not set(blocks) & set(checkpoint.dense)   # nothing dequantized before it is asked for

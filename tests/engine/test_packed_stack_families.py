"""The whole-stack path (packed_stack.py, decoder_stack.c) beyond Llama-style GGUF
layers: Qwen2 (a qkv bias), Qwen3 (q/k norms), Mistral (every layer sliding) and
Gemma 3 (q/k norms, sandwich norms, (1 + weight) norms, GELU-tanh, sliding and full
layers with their own rotary tables), each a tiny random bf16-weights model saved
with transformers. The stack's final hidden states and caches equal the layer loop's
(bit for bit where the loop runs the same kernels; Gemma 3's torch norms to float
rounding) on decode steps and on steps with prefill chunks (sliding layers: each row
over its window); Qwen2's packed layers equal its modules; the paired MLP
(paired_mlp.py) that both paths share equals the unfused modules."""


from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.models.block_weights import BF16_KERNEL_ROWS
from engine.models.layers import GatedMLP
from engine.models.packed_stack import PackedStack
from engine.models.paired_mlp import PairedMLP

from tests.engine.test_packed_layer import StepRuns, _batch
from tests.helpers import ServedSpy, executors_set_to, layer_executors, needs_bf16_gemm

pytestmark = needs_bf16_gemm

VOCAB = 211


def _configs() -> dict:
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    gemma = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        max_position_embeddings=512, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    qwen3 = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                        tie_word_embeddings=False)
    mistral = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=80,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=7, max_position_embeddings=512)
    qwen2 = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return {"gemma3": (Gemma3ForCausalLM, gemma), "qwen3": (Qwen3ForCausalLM, qwen3),
            "mistral": (MistralForCausalLM, mistral), "qwen2": (Qwen2ForCausalLM, qwen2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> the tiny model loaded in bf16-weights."""
    loaded = {}
    for seed, (family, (model_type, config)) in enumerate(_configs().items()):
        torch.manual_seed(40 + seed)
        path = tmp_path_factory.mktemp(f"stack-{family}")
        reference = model_type(config).eval()
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name.endswith(".bias"):          # transformers starts them at zero
                    parameter.normal_(0.0, 0.5)
        reference.save_pretrained(path)
        loaded[family] = load_model(path, dtype="bf16-weights", progress=False)
    return loaded


def stack_and_loop(model, batch):
    """(stack's hidden, caches), (loop's hidden, caches) from the same cache contents,
    and whether the stack served the step."""
    module, runs = model.module, StepRuns(model, batch, seed=2)
    spy, results = ServedSpy(module.executors.stacks[0]), []
    for stacks in ((spy,), ()):
        with executors_set_to(module, replace(module.executors, stacks=stacks)):
            results.append(runs.run())
    return results[0], results[1], spy.served[0]


DECODES = [(10 + i, 11 + i) for i in range(5)]
MIXED = [(0, 12), (20, 21), (30, 31), (9, 14)]      # chunks longer than the 7-token window


def assert_same(stacked_run, looped_run, family: str) -> None:
    (stacked, stacked_caches), (looped, looped_caches) = stacked_run, looped_run
    if family == "gemma3":           # torch's offset norms and GELU, summed another way
        torch.testing.assert_close(stacked, looped, rtol=1e-5, atol=1e-5)
        assert not torch.equal(stacked, torch.zeros_like(stacked))
    else:
        assert torch.equal(stacked, looped)
    assert all(torch.equal(a, b) for a, b in zip(stacked_caches, looped_caches))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("shapes", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_every_family_runs_its_steps_on_the_stack(models, family, shapes):
    """Decode steps, and steps with prefill chunks (in sliding layers each row over
    its window's part of the context)."""
    model = models[family]
    assert [type(s) for s in model.module.executors.stacks] == [PackedStack]
    stacked, looped, served = stack_and_loop(model, _batch(VOCAB, shapes))
    assert served
    assert_same(stacked, looped, family)


def test_qwen2_packed_layers_equal_its_modules(models):
    """The layer loop's Qwen2 layers: packed, their qkv bias added to the fp32 product
    as the modules add it."""
    from engine.models.packed_layer import PackedLayer
    from tests.engine.test_packed_layer import assert_identical, run_both_ways

    model = models["qwen2"]
    assert all(isinstance(e, PackedLayer) and e.qkv_bias is not None
               for e in layer_executors(model.module, PackedLayer))
    for shapes in (DECODES, MIXED):
        results, served = run_both_ways(model, _batch(VOCAB, shapes))
        assert_identical(results)
        assert served == len(model.module.layers)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_paired_mlp_equals_the_unfused_modules(models, family):
    """SiLU (Qwen3) and GELU-tanh (Gemma 3) from the gated GEMM against torch's
    activation of the same fp32 products: within one bf16 rounding of the
    activation, carried through down."""
    mlp = models[family].module.layers[1].mlp
    assert isinstance(mlp.fused, PairedMLP)
    x = torch.randn(6, models[family].config.hidden_size, generator=torch.Generator().manual_seed(1))
    fused = mlp(x)
    unfused = GatedMLP(mlp.gate_up_proj, mlp.down_proj, mlp.act_name)(x)   # no native path
    torch.testing.assert_close(fused, unfused, rtol=2e-2, atol=2e-3)
    assert (fused - unfused).abs().max() < 0.02 * unfused.abs().max()


def test_gemma3_generates_the_same_tokens_with_and_without_the_stack(models):
    model = models["gemma3"]
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 14)]       # past the 7-token window
    config = GenerationConfig(max_new_tokens=10, eos_token_id=[])
    module, runs = model.module, []
    spy = ServedSpy(module.executors.stacks[0])
    for stacks in ((spy,), ()):
        with executors_set_to(module, replace(module.executors, stacks=stacks)):
            outputs = model.generate_batch(prompts, config, ContinuousBatchingConfig(page_size=8))
            runs.append([output.generated_tokens for output in outputs.values()])
    assert runs[0] == runs[1] and all(len(tokens) == 10 for tokens in runs[0])
    assert spy.served and all(spy.served)                      # its own sliding pool too


def test_paired_mlp_leaves_block_kernel_steps_to_the_blocks():
    """On a GGUF model in bf16-weights the steps of up to the blocks' rows stay on the
    exact block kernels: a PairedMLP built there declines them."""

    model = load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)
    mlp = model.module.layers[0].mlp              # (a FusedBlockMLP serves it normally)
    paired = PairedMLP.build(mlp.gate_up_proj, mlp.down_proj, mlp.act_name)
    assert paired is not None and paired.block_rows == BF16_KERNEL_ROWS
    hidden = model.config.hidden_size
    assert paired(torch.randn(BF16_KERNEL_ROWS, hidden)) is None
    assert paired(torch.randn(BF16_KERNEL_ROWS + 1, hidden)).shape == (BF16_KERNEL_ROWS + 1, hidden)


@needs_bf16_gemm
@pytest.mark.slow
def test_gemma3_gguf_short_steps_run_on_the_blocks():
    """Gemma 3 270M's layers hold GGUF blocks and a fast decode path: in bf16-weights
    steps of up to BF16_KERNEL_ROWS rows take the fast decode stack on the blocks,
    larger ones the bf16 stack, and the step benchmark counts the bytes each reads."""
    from bench.bounds import matmul_flops_per_row, weight_bytes_per_step
    from engine.models.fast_decode import FastDecodeStack

    model = load_model("gemma3-270m", dtype="bf16-weights", progress=False)
    module = model.module
    assert [type(s) for s in module.executors.stacks] == [FastDecodeStack, PackedStack]
    fast, packed = module.executors.stacks
    assert fast.max_rows == packed.block_rows == BF16_KERNEL_ROWS
    projection_weights = matmul_flops_per_row(module) // 2 - module.embed_tokens.weight.numel()
    on_blocks = weight_bytes_per_step(module, BF16_KERNEL_ROWS)
    on_stack = weight_bytes_per_step(module, BF16_KERNEL_ROWS + 1)
    # bf16 (2 bytes a weight) against the blocks' ~1.1: the bf16 stack's step reads more
    assert on_stack - on_blocks > 0.3 * 2 * projection_weights

"""Families we have no code for run on transformers' modeling code with the paged
attention (engine/models/transformers_path.py): greedy tokens equal transformers'
`generate`, through continuous batching, prefix caching, preemption and sliding
windows; architectures the paged cache cannot serve are refused at load, by name."""

import json

import pytest
import torch

from engine import ContinuousBatchingConfig
from engine.loading.model_files import ModelLoadError
from engine.model_api import load_model
from engine.models.transformers_path import TransformersCausalLM, UnsupportedModelError
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=211, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "phi3": {},
    "gpt_neox": {},                                    # parallel residual, partial RoPE
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),   # layers in `h`
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "starcoder2": dict(sliding_window=7),              # every layer slides
    "gemma2": dict(attn_logit_softcapping=None, head_dim=16, sliding_window=7),
    "granite": dict(logits_scaling=4.0),               # the head divides its logits
    "cohere": dict(logit_scale=0.5),                   # the head scales its logits
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}
"""model_type -> what its tiny config sets beyond SMALL. gemma2 (sliding and full
layers alternating, final logit soft-capping) runs here with attention soft-capping
off; with it on it is refused (test below)."""


def tiny_reference(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES.get(model_type, {}),
                                                 **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers(model_type):
    reference = tiny_reference(model_type)
    model = load_model(reference, progress=False)
    assert isinstance(model.module, TransformersCausalLM)
    prompts = random_prompts(4, 3, 30, seed=1)          # longer than the 7-token windows
    tokens, _ = generate_and_inspect(model, prompts, 12, num_blocks=64, page_size=8)
    assert tokens == [reference_greedy(reference, p, 12) for p in prompts]


def test_sliding_layers_come_from_the_layers_own_calls():
    gemma2 = load_model(tiny_reference("gemma2", num_hidden_layers=4), progress=False).module
    assert gemma2.sliding_window == 7
    assert gemma2.layer_is_sliding == [True, False, True, False]
    starcoder = load_model(tiny_reference("starcoder2"), progress=False).module
    assert starcoder.layer_is_sliding == [True, True]
    phi3 = load_model(tiny_reference("phi3"), progress=False).module
    assert phi3.sliding_window is None and phi3.layer_is_sliding == [False, False]


def test_head_traits_are_applied():
    """Granite divides its logits, Cohere scales them: without the trait the logits
    would be off by that factor."""
    prompt = random_prompts(1, 9, 9, seed=2)[0]
    for model_type in ("granite", "cohere", "gemma2"):
        reference = tiny_reference(model_type)
        model = load_model(reference, progress=False)
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(model.prompt_logits(prompt), expected, rtol=1e-4, atol=1e-4)


def test_prefix_caching_and_preemption_keep_the_tokens():
    reference = tiny_reference("phi3", seed=3)
    model = load_model(reference, progress=False)
    shared = random_prompts(1, 24, 24, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts(6, 2, 9, seed=5)]
    expected = [reference_greedy(reference, p, 16) for p in prompts]
    cached, stats = generate_and_inspect(model, prompts, 16, num_blocks=64, page_size=8,
                                         allow_block_sharing=True)
    assert cached == expected and stats["prefix_cache_hits"] > 0
    squeezed, stats = generate_and_inspect(model, prompts, 16, num_blocks=12, page_size=8,
                                           max_batch_tokens=64)
    assert squeezed == expected and stats["num_preemptions"] > 0


def test_a_saved_directory_loads_on_this_path(tmp_path):
    reference = tiny_reference("gpt_neox", seed=6)
    reference.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), progress=False)
    assert isinstance(model.module, TransformersCausalLM)
    prompt = random_prompts(1, 5, 5, seed=7)[0]
    outputs = model.generate_batch([prompt], max_new_tokens=8, eos_token_id=[])
    assert list(outputs.values())[0].generated_tokens == reference_greedy(reference, prompt, 8)


@pytest.mark.parametrize("model_type, overrides, message", [
    ("gemma2", dict(attn_logit_softcapping=50.0), "soft-capping"),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16), "sinks"),
    ("jamba", dict(num_experts=2, num_experts_per_tok=1), "only attention layers"),
])
def test_architectures_the_cache_cannot_serve_are_refused_at_load(model_type, overrides,
                                                                   message):
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(tiny_reference(model_type, **overrides), progress=False)


@pytest.mark.parametrize("dtype", ["bf16-weights", "int8-weights", "int8-activations"])
def test_weights_only_dtypes_need_our_families(dtype):
    with pytest.raises(ValueError, match=f"{dtype} needs one of our model families; "
                                         f"model_type 'phi3'"):
        load_model(tiny_reference("phi3"), dtype=dtype, progress=False)


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    with pytest.raises(ModelLoadError, match="model_type 'frobnicator'"):
        load_model(str(tmp_path), progress=False)


@pytest.mark.parametrize("method, name", [("awq", "AWQ"), ("gptq", "GPTQ"), ("fp8", "FP8")])
def test_quantized_checkpoints_get_a_clear_error(tmp_path, method, name):
    reference = tiny_reference("phi3")
    reference.config.quantization_config = {"quant_method": method, "bits": 4}
    reference.config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"quantized with {name}"):
        load_model(str(tmp_path), progress=False)

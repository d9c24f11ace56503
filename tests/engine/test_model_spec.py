"""The model's declaration to the engine (engine/model_spec.py): every family states
its cache shape, sliding layers and KV dtype once, and a spec that cannot describe a
model is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from engine.model_spec import EngineModelSpec


def spec(**changes) -> EngineModelSpec:
    fields = dict(num_layers=4, num_kv_heads=2, head_dim=16, layer_is_sliding=(False,) * 4,
                  sliding_window=None, kv_cache_dtype=None, hidden_size=64,
                  intermediate_size=96, max_context=512)
    fields.update(changes)
    return EngineModelSpec(**fields)


@pytest.mark.parametrize("changes, field", [
    ({"num_layers": 0, "layer_is_sliding": ()}, "num_layers"),
    ({"num_kv_heads": 2.0}, "num_kv_heads"),
    ({"head_dim": True}, "head_dim"),
    ({"layer_is_sliding": (False,) * 3}, "layer_is_sliding has 3 entries for 4 layers"),
    ({"layer_is_sliding": (True, False, True, False)}, "sliding_window: sliding layers need"),
    ({"sliding_window": 0}, "sliding_window must be positive"),
    ({"max_context": 0}, "max_context"),
])
def test_a_spec_that_cannot_describe_a_model_names_the_field(changes, field):
    with pytest.raises(ValueError, match=f"EngineModelSpec.{field}"):
        spec(**changes)


def test_sliding_pools_and_the_kv_dtype():
    hybrid = spec(layer_is_sliding=(True, False, True, True), sliding_window=8)
    assert hybrid.pooled_sliding and hybrid.has_full_layers
    mistral = spec(layer_is_sliding=(True,) * 4, sliding_window=8)
    assert mistral.pooled_sliding and not mistral.has_full_layers
    assert not spec().pooled_sliding and spec().has_full_layers
    cpu = torch.device("cpu")
    assert spec().kv_dtype(cpu, torch.bfloat16) == torch.float32      # CPU default: fp32
    assert spec(kv_cache_dtype=torch.bfloat16).kv_dtype(cpu, torch.float32) == torch.bfloat16
    assert spec().kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 16 * 2


def test_every_family_declares_its_spec(tiny_models, tiny_gemma3, tiny_mistral):
    from engine import load_model

    for family, (path, reference) in tiny_models.items():
        declared = load_model(path, progress=False).module.engine_spec()
        config = reference.config
        head_dim = (getattr(config, "head_dim", None)             # Qwen3's is its own
                    or config.hidden_size // config.num_attention_heads)
        assert (declared.num_layers, declared.num_kv_heads, declared.head_dim) == (
            config.num_hidden_layers, config.num_key_value_heads, head_dim), family
        assert declared.kv_cache_dtype is None and not declared.pooled_sliding
    gemma = tiny_gemma3[0].module.engine_spec()
    assert gemma.layer_is_sliding == (True, True, False, True) and gemma.sliding_window == 7
    mistral = tiny_mistral[0].module.engine_spec()
    assert mistral.pooled_sliding and not mistral.has_full_layers


def test_the_load_plan_sets_the_kv_dtype_the_engine_reads(tiny_models):
    from engine import load_model

    from engine.kv_cache.sizing import CacheSizing
    from engine.step.runner import ModelRunner

    path, _ = tiny_models["qwen2"]
    model = load_model(path, progress=False, kv_cache_dtype="bfloat16")
    assert model.module.engine_spec().kv_cache_dtype == torch.bfloat16
    runner = ModelRunner(model.module, CacheSizing(8, 16, 64, 4, 0), seed=0)
    assert {cache.dtype for cache in runner.cache.key_caches} == {torch.bfloat16}
    declared = model.module.engine_spec()
    assert runner.cache.key_caches[0].shape[-2:] == (declared.num_kv_heads, declared.head_dim)

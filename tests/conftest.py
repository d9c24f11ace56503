"""Shared fixtures: tiny random models of each family, built with transformers and
saved with save_pretrained (no downloads), plus the transformers reference."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from tests.helpers import SLIDING_WINDOW, TINY_FAMILIES, model_class, tiny_config

@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (path of the saved model, transformers reference model)."""
    models = {}
    for index, family in enumerate(TINY_FAMILIES):
        torch.manual_seed(1234 + index)
        reference = model_class(family)(tiny_config(family)).eval()
        with torch.no_grad():            # transformers starts biases (Qwen2's qkv) at zero
            for name, parameter in reference.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, 0.5)
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        reference.save_pretrained(path)
        models[family] = (path, reference)
    return models


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    path, reference = tiny_models["llama"]
    return load_model(path, progress=False), reference


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(5)
    config = Gemma3TextConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    reference = Gemma3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-gemma3")
    reference.save_pretrained(path)
    return load_model(path, progress=False), reference


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(6)
    config = MistralConfig(vocab_size=211, hidden_size=48, intermediate_size=80,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=SLIDING_WINDOW, max_position_embeddings=512)
    reference = MistralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-mistral")
    reference.save_pretrained(path)
    return load_model(path, progress=False), reference

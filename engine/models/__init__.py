"""Our own decoder implementations, one file per family, and the registry that picks
one from a transformers config."""

from __future__ import annotations

from typing import Any

import torch

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaFamilyForCausalLM
from .model_parts import ModelParts

MODEL_REGISTRY = {
    "llama": LlamaFamilyForCausalLM,
    "mistral": LlamaFamilyForCausalLM,
    "qwen2": LlamaFamilyForCausalLM,
    "qwen3": LlamaFamilyForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}
OWN_MODEL_TYPES = frozenset(MODEL_REGISTRY)
"""The model_types one of our decoder implementations serves."""


def has_own_code(config: Any) -> bool:
    """Whether one of our decoder implementations serves `config.model_type` (others
    run on transformers' modeling code: transformers_path.py)."""
    return getattr(config, "model_type", None) in MODEL_REGISTRY


def build_model(config: Any, parts: ModelParts) -> torch.nn.Module:
    """Our model class for `config.model_type`, built whole from `parts`
    (model_parts.py: the checkpoint's tensors, the load plan's choices)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[model_type](config, parts).eval()

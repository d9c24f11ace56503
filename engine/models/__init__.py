"""Our own decoder implementations, one file per family, and the registry that picks
one from a transformers config."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaFamilyForCausalLM

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


def build_model(config: Any, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device,
                prepare: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None
                ) -> torch.nn.Module:
    """Instantiate our model class for `config.model_type` and load the weights.
    `prepare(model)`, called before loading (the parameters allocated, not written),
    may swap modules and returns the state dict to load instead of `state_dict`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{sorted(MODEL_REGISTRY)}")
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        model = MODEL_REGISTRY[model_type](config)
    _allocate(model, dtype, device)
    model.load_hf_state_dict(state_dict if prepare is None else prepare(model))
    model.reset_buffers(device)  # buffers are not in the checkpoint; rebuild in fp32
    return model.eval()


def _allocate(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter made on the meta device real, unwritten storage on
    `device` (floating ones in `dtype`): what to_empty and to(dtype) do, but through
    the plain factory, since their meta-tensor paths import torch's symbolic-shape
    machinery (a quarter second and ~35 MB of a server's start)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                kind = dtype if param.is_floating_point() else param.dtype
                module.register_parameter(name, torch.nn.Parameter(
                    torch.empty(param.shape, dtype=kind, device=device),
                    requires_grad=param.requires_grad))

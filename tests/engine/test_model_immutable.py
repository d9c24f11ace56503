"""A built model is final (models/model_parts.py): a manager built on it, its runner,
its attention backend and its steps leave every attribute of every submodule as the
load left it, so managers can share one model, one after another or side by side."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model


def attributes(module: torch.nn.Module) -> dict[str, tuple]:
    """Every submodule's attributes, parameters, buffers and children by path, each as
    (type, identity), plus each tensor's storage and version (a write in place)."""
    seen = {}
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            values = value.items() if name in ("_parameters", "_buffers", "_modules") \
                else [(name, value)]
            for key, item in values:
                state = (type(item).__name__, id(item))
                if isinstance(item, torch.Tensor):
                    state += (item.data_ptr(), item._version)
                seen[f"{path}.{key}"] = state
    return seen


@pytest.mark.parametrize("spec, dtype", [("smollm2-135m-instruct", None),
                                         ("tiny", "bf16-weights")])
def test_managers_leave_a_loaded_model_as_it_was(tiny_models, spec, dtype):
    """The default model (GGUF blocks, native executors) and a dense one in another
    mode: before and after two managers of different settings generate on it."""
    source = tiny_models["llama"][0] if spec == "tiny" else spec
    model = load_model(source, dtype=dtype, progress=False)
    before = attributes(model.module)
    assert len(before) > 50
    config = GenerationConfig(max_new_tokens=4, eos_token_id=[])
    for settings in (ContinuousBatchingConfig(page_size=16),
                     ContinuousBatchingConfig(page_size=32, max_batch_tokens=64)):
        outputs = model.generate_batch([[5, 6, 7], [8, 9] * 20], config, settings)
        assert all(len(o.generated_tokens) == 4 for o in outputs.values())
    assert attributes(model.module) == before

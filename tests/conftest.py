"""Shared fixtures: tiny random models of each family, built with transformers and
saved with save_pretrained (no downloads), plus the transformers reference."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY_FAMILIES, model_class, tiny_config

@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (path of the saved model, transformers reference model)."""
    models = {}
    for index, family in enumerate(TINY_FAMILIES):
        torch.manual_seed(1234 + index)
        reference = model_class(family)(tiny_config(family)).eval()
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        reference.save_pretrained(path)
        models[family] = (path, reference)
    return models


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    from engine import load_model

    path, reference = tiny_models["llama"]
    return load_model(path, progress=False), reference

"""Sequence-classification checkpoints (engine/models/classifier_head.py): a
*ForSequenceClassification decoder loads with its `score` head, and a classifying
pooling request's label logits equal transformers' `model(ids).logits` through
chunked prefill; the manager refuses what the model's heads cannot answer."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, Pooling, load_model
from engine.errors import InvalidRequestError
from engine.models.classifier_head import UnsupportedClassifierError
from tests.helpers import random_prompts

CLASSIFY = Pooling("last", normalize=False, classify=True)


def save_classifier(path, family: str, num_labels: int):
    from transformers import (Gemma3TextConfig, LlamaConfig, LlamaForSequenceClassification,
                              Qwen2Config, Qwen2ForSequenceClassification)

    torch.manual_seed(3)
    shape = dict(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels,
                 pad_token_id=None, max_position_embeddings=256)
    if family == "gemma3_text":
        from transformers import Gemma3ForSequenceClassification
        model = Gemma3ForSequenceClassification(Gemma3TextConfig(head_dim=8, **shape))
    else:
        config_class, model_class = {"llama": (LlamaConfig, LlamaForSequenceClassification),
                                     "qwen2": (Qwen2Config, Qwen2ForSequenceClassification)}[family]
        model = model_class(config_class(**shape))
    model.eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("family, num_labels", [("qwen2", 1), ("llama", 3)])
def test_label_logits_match_transformers_through_chunks(tmp_path, family, num_labels):
    reference = save_classifier(tmp_path, family, num_labels)
    model = load_model(tmp_path, progress=False)
    assert model.module.engine_spec().num_labels == num_labels
    prompts = random_prompts(4, 3, 60, seed=5)
    manager = model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=24))
    manager.start()
    try:
        ids = [manager.add_request(p, pooling=CLASSIFY) for p in prompts]
        outputs = [manager.get_result(i, timeout=60) for i in ids]
        with pytest.raises(InvalidRequestError, match="sequence classifier"):
            manager.add_request(prompts[0], max_new_tokens=2)
        vector = manager.get_result(manager.add_request(prompts[0], pooling=Pooling("last")),
                                    timeout=60)
    finally:
        manager.stop()
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0]
        assert output.generated_tokens == [] and len(output.embedding) == num_labels
        assert torch.allclose(torch.tensor(output.embedding), want, atol=1e-5, rtol=1e-4)
    assert len(vector.embedding) == 32        # a classifier's hidden states pool too


def test_a_causal_lm_refuses_classifying_requests(tiny_models):
    path, _ = tiny_models["qwen2"]
    manager = load_model(path, progress=False).init_continuous_batching()
    with pytest.raises(InvalidRequestError, match="no sequence-classification head"):
        manager.add_request([1, 2, 3], pooling=CLASSIFY)


def test_classifying_pooling_is_not_normalised():
    with pytest.raises(InvalidRequestError, match="pooling.normalize"):
        Pooling("last", normalize=True, classify=True)


def test_a_family_without_a_head_is_refused_at_load(tmp_path):
    save_classifier(tmp_path, "gemma3_text", 1)
    with pytest.raises(UnsupportedClassifierError, match="'gemma3_text'"):
        load_model(tmp_path, progress=False)

"""Sequence-classification checkpoints: a decoder whose LM head is replaced by a small
linear `score` head, as cross-encoder rerankers are saved by transformers.

    config.json   "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1
    weights       model.* (the decoder, as a causal LM's)
                  score.weight [num_labels, hidden]   (no bias, no lm_head.weight)

transformers applies `score` to every position's final hidden state (after the
model's last norm) and keeps the last non-padding token's row. The engine pools the
last prompt token's final hidden state (engine/pooling.py, `classify`) and applies
the head to that row alone: the same logits for an unpadded pair.

Our Llama-family decoders (llama, mistral, qwen2, qwen3) take such checkpoints; for
other families the load refuses them with an error naming the family.
"""

from __future__ import annotations

from typing import Any


SEQUENCE_CLASSIFIER_SUFFIX = "ForSequenceClassification"
CLASSIFIER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""The model_types whose sequence-classification checkpoints the engine serves."""


class UnsupportedClassifierError(ValueError):
    """A sequence-classification checkpoint of a family the engine has no head for."""


def classifier_labels(config: Any) -> int | None:
    """The head's number of labels when `config` is a sequence-classification
    checkpoint's (its `architectures` name a *ForSequenceClassification class), else
    None (a causal LM)."""
    architectures = getattr(config, "architectures", None) or ()
    if not any(str(name).endswith(SEQUENCE_CLASSIFIER_SUFFIX) for name in architectures):
        return None
    return int(config.num_labels)


def check_classifier_family(config: Any) -> None:
    """Refuse a sequence-classification checkpoint of a family without a head here."""
    model_type = getattr(config, "model_type", None)
    if classifier_labels(config) is not None and model_type not in CLASSIFIER_MODEL_TYPES:
        raise UnsupportedClassifierError(
            f"sequence-classification checkpoints of model_type {model_type!r} are not "
            f"supported; the engine serves those of {', '.join(sorted(CLASSIFIER_MODEL_TYPES))}")

"""Encoder embedding models (BERT-like checkpoints): bidirectional attention over the
whole input at once, so they run beside the paged engine, not in it: no KV cache,
no chunked prefill. `load_model` returns an EncoderModel for their configs
(model.py); its manager (manager.py) takes the embedding subset of the
ContinuousBatchingManager's API and runs padded batches (batching.py)."""

from .model import ENCODER_MODEL_TYPES, EncoderModel, is_encoder_config, load_encoder

__all__ = ["ENCODER_MODEL_TYPES", "EncoderModel", "is_encoder_config", "load_encoder"]

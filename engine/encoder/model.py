"""EncoderModel: a transformers encoder (BertModel and its kin) loaded for embedding
requests, with the parts of EngineModel's surface a server reads (config,
tokenizer, device, generation_config) and `init_continuous_batching`, which gives an
EncoderManager (manager.py) instead of the paged engine's manager.

Which checkpoints: those whose config's model_type is one of ENCODER_MODEL_TYPES
(bidirectional self-attention, no causal LM head). The weights load through
transformers' AutoModel: the encoder's `last_hidden_state` is what is pooled; a
checkpoint's task heads (masked-LM, pooler) are not used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..generation_config import GenerationConfig

logger = logging.getLogger(__name__)

ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet",
                                 "electra", "camembert", "modernbert"})
"""model_types served as encoder embedding models."""

ENCODER_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}
"""The dtype names an encoder takes ("auto": loading.auto_dtype)."""


def is_encoder_config(config: Any) -> bool:
    return getattr(config, "model_type", None) in ENCODER_MODEL_TYPES


class EncoderModel:
    def __init__(self, module: torch.nn.Module, config: Any, tokenizer: Any) -> None:
        self.module = module
        self.config = config
        self.tokenizer = tokenizer
        parameter = next(module.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.generation_config = GenerationConfig(eos_token_id=None)
        """No generation: only for the server's reading of eos ids."""
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self.max_context = int(config.max_position_embeddings)
        self.tp_group = None
        """Always None: an encoder runs on one device."""

    @property
    def generates(self) -> bool:
        """Whether the model can generate text: never, an encoder has no LM head."""
        return False

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 **_: Any):
        """An EncoderManager for this model (its max_batch_tokens and max_queue_size
        from `continuous_batching_config`); the caller starts and stops it."""
        from ..config import ContinuousBatchingConfig
        from .manager import EncoderManager

        config = ContinuousBatchingConfig.from_any(continuous_batching_config)
        return EncoderManager(self, config.max_batch_tokens, config.max_queue_size)


def load_encoder(model_dir: Path, config: Any, dtype: str, device: torch.device,
                 tokenizer: Any, tp_size: int) -> EncoderModel:
    """The encoder in `model_dir` on `device`; a dtype mode other than ENCODER_DTYPES'
    or tensor parallelism is a ValueError naming it."""
    from transformers import AutoModel

    from ..loading.model_files import auto_dtype

    if dtype not in ENCODER_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not available for encoder models "
                         f"({config.model_type!r}); use one of {', '.join(ENCODER_DTYPES)}")
    if tp_size != 1:
        raise ValueError(f"encoder models ({config.model_type!r}) run on one device; "
                         f"tp_size {tp_size} is not available")
    compute = ENCODER_DTYPES[dtype] or auto_dtype(config, device)
    module = AutoModel.from_pretrained(str(model_dir), dtype=compute)
    logger.info("model_type %r runs as an encoder embedding model (transformers' modeling "
                "code, padded batches, no KV cache)", config.model_type)
    return EncoderModel(module.to(device).eval(), config, tokenizer)

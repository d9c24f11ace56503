"""Which drafts' source an engine gets, decided once when the engine is built
(core/engine_setup.py): none when speculative decoding is off or cannot serve (each
refusal logged with its reason), else the method's proposer: prompt lookup or the
suffix cache (proposer.py), or a draft model loaded beside the target
(draft_model.py). The engine's other parts see only the Proposer protocol."""

from __future__ import annotations

import logging
from typing import Any

from ..kv_cache.sizing import CacheSizing
from .config import SpeculativeConfig
from .proposer import NgramProposer, Proposer, SuffixProposer

logger = logging.getLogger(__name__)


def refusal(distributed: bool, async_batching: bool, pooled_sliding: bool) -> str | None:
    """Why speculative decoding cannot serve this engine, or None when it can."""
    if distributed:
        return "tensor parallelism"
    if async_batching:
        return "async batching (a step's tokens are fed before they are read back)"
    return "sliding-window layers" if pooled_sliding else None


def choose_proposer(config: SpeculativeConfig | None, target: Any, sizing: CacheSizing,
                    refused: str | None) -> Proposer | None:
    """The proposer of `config`'s method for `target` (an EngineModel), or None when
    speculation is off or `refused` (a reason from `refusal`)."""
    if config is None:
        return None
    if refused is not None:
        logger.warning("speculative decoding off: %s", refused)
        return None
    logger.info("speculative decoding: %s, up to %d drafts a step", config.method,
                config.num_speculative_tokens)
    if config.method == "draft_model":
        from .draft_model import load_draft_proposer

        return load_draft_proposer(config, target, sizing)
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)

"""Which optional features a model and device get, decided once when a manager is
built, each refusal logged with its reason: prefix caching and CPU offload (off for
sliding-window models, whose sliding layers recycle pages in a pool of their own) and
the decode fast path (needs flash_attn_with_kvcache and no sliding layers)."""

from __future__ import annotations

import logging

from .config import ContinuousBatchingConfig

logger = logging.getLogger(__name__)


def adjust_for_sliding(config: ContinuousBatchingConfig, sliding_window: int | None,
                       pooled: bool) -> ContinuousBatchingConfig:
    """Sliding layers recycle pages, so their blocks cannot be shared by prefix; their
    separate pool is not handled by CPU offload yet."""
    if sliding_window is None:
        return config
    if config.allow_block_sharing:
        logger.info("prefix caching off: the model has sliding-window layers")
        config = config.replace(allow_block_sharing=False)
    if pooled and config.cpu_offload_space != 0:
        logger.info("CPU offload off: sliding-window models are preempted by recompute")
        config = config.replace(cpu_offload_space=0.0)
    return config


def decode_fast_path(config: ContinuousBatchingConfig, max_blocks_per_request: int,
                     sliding_window: int | None, device) -> bool:
    """Whether decode-only batches may use flash_attn_with_kvcache. Off when disabled
    (max_blocks_per_request=0), for sliding-window models, or without the kernel; the
    reason is logged as a warning only when the user set max_blocks_per_request."""
    from .attention.backend import flash_available

    if max_blocks_per_request == 0:
        return False
    reason = None
    if sliding_window is not None:
        reason = "the model has sliding-window layers"
    elif not flash_available(device):
        reason = "flash_attn_with_kvcache is not available on this device"
    if reason is None:
        return True
    log = logger.warning if config.max_blocks_per_request else logger.info
    log("decode fast path off: %s; decode batches use the varlen path", reason)
    return False

"""The attention backend seam: models call `backend.forward(...)` and never care
whether pages are read by torch gathers or by a fused kernel. A backend is chosen at
run time by name (`get_backend`); `switch_to_cb_friendly_attn` sets it on a model."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from .metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, cache_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] for this step's tokens; the caches
        [num_blocks, page_size, KVH, D] of one layer. Writes the new K/V into the
        cache at `meta.slot_mapping` (unless the caller already has: `cache_written`)
        and returns the attention output [T, H, D]."""
        ...


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(name: str) -> AttentionBackend:
    from .torch_backend import TorchPagedAttention

    if name in ("torch", "sdpa", "eager", "paged|eager", "paged|sdpa"):
        return TorchPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch'")


def switch_to_cb_friendly_attn(model, auto_switch_to_flash: bool = True) -> str:
    """Give `model` (an engine model with an `attn_backend` attribute) an attention
    implementation that works on the paged cache. Flash attention is used when asked
    for, on CUDA, and installed; otherwise the torch backend. Returns its name."""
    device = next(model.parameters()).device
    if auto_switch_to_flash and flash_available(device):
        logger.info("flash-attn is installed but its paged path is not built yet; using torch")
    model.attn_backend = get_backend("torch")
    return model.attn_backend.name

"""The attention backend seam: models call `backend.forward(...)` and never care
whether pages are read by torch gathers or by a fused kernel. A backend is chosen at
run time by name (`get_backend`): "torch" (torch_backend.py: any device, the native
CPU kernels) or "flash" (flash_backend.py: flash-attn on CUDA);
`choose_backend` picks one per engine (flash on CUDA when `auto_switch_to_flash` is
on and it serves), and the runner passes it into every forward."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from .metadata import AttentionMetadata, MetadataBuilder

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str
    needs_block_tables: bool
    """Every step's AttentionMetadata carries block_table & co (flash attention)."""

    def decode_fast_path_on(self, device: torch.device) -> bool:
        """Whether decode-only steps over fixed-width block tables (the decode fast
        path, and so CUDA graphs) serve on `device`."""
        ...

    def metadata_builder(self, page_size: int, step_queries: bool = False) -> MetadataBuilder:
        """The builder of its steps' metadata (metadata.py); `step_queries`: the native
        CPU kernel serves the model's head size."""
        ...

    def decode_gather(self, seq_lens: torch.Tensor, block_table: torch.Tensor,
                      page_size: int, window: int | None, dtype: torch.dtype):
        """What its fixed-table decode reads besides the tables, built once per step
        with them (FixedTableMetadata.gather; attention in `dtype`), or None."""
        ...

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, cache_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] for this step's tokens; the caches
        [num_blocks, page_size, KVH, D] of one layer. Writes the new K/V into the
        cache at `meta.slot_mapping` (unless the caller already has: `cache_written`)
        and returns the attention output [T, H, D]."""
        ...


def get_backend(name: str) -> AttentionBackend:
    from .torch_backend import TorchPagedAttention

    if name in ("torch", "sdpa", "eager", "paged|eager", "paged|sdpa"):
        return TorchPagedAttention()
    if name in ("flash", "flash_attention_2", "paged|flash_attention_2"):
        from .flash_backend import FlashPagedAttention
        return FlashPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch', 'flash'")


def choose_backend(model, auto_switch_to_flash: bool = True,
                   page_size: int | None = None) -> AttentionBackend:
    """The attention implementation an engine's steps on `model` use (the runner holds
    it; the model is never changed): flash attention when asked for and it can serve
    this device, cache dtype and `page_size` (None: not known yet, not checked);
    otherwise the torch backend, with the reason logged on CUDA."""
    if auto_switch_to_flash:
        reason = _flash_refusal(model, page_size)
        if reason is None:
            return get_backend("flash")
        if next(model.parameters()).device.type == "cuda":
            logger.info("attention: torch backend (%s)", reason)
    return get_backend("torch")


def _flash_refusal(model, page_size: int | None) -> str | None:
    """Why flash attention cannot serve `model` with pages of `page_size`, or None."""
    from .flash_backend import flash_unsupported_reason

    parameter, spec = next(model.parameters()), model.engine_spec()
    return flash_unsupported_reason(parameter.device,
                                    spec.kv_dtype(parameter.device, parameter.dtype),
                                    page_size, spec.head_dim)

"""Paged attention through flash-attn's kernels (CUDA, fp16/bf16 tensors).

Per layer: the step's new K/V go into the cache pages at `meta.slot_mapping` (one
index_copy_ per cache), then one kernel call reads every request's context through
its row of `meta.block_table`, the caches being in flash-attn's paged layout already
([num_blocks, page_size, KVH, D]):
- decode-only steps whose tables have the fixed width max_blocks_per_request
  (FixedTableMetadata) call `flash_attn_with_kvcache`: one query per request
  over keys 0..seq_len-1. Its shapes depend only on the number of requests, which is
  what lets CUDA graphs replay it;
- every other step (FlashMetadata) calls `flash_attn_varlen_func` over the flat batch. Its causal
  mask is aligned to each request's last key: query i of a chunk that starts at
  position s sees keys 0..s+i, so chunked prefill, prompts resumed after a prefix-cache
  hit and decodes share one call.
Sliding layers pass window_size=(window - 1, 0): a query at position p sees keys
p-window+1..p, the engine's rule (q - window < k <= q).

Where this backend applies (`flash_unsupported_reason`): CUDA (compute capability 8.0+),
flash-attn 2.5.7+ installed, fp16/bf16 caches, pages of a multiple of 256 tokens
(flash-attn's paged kernels need it), head sizes a multiple of 8 up to 256.
`choose_backend` (backend.py) only picks it there. The kernels arrive as a
`FlashFunctions`, so a reference implementation of the same contract can drive this
code where flash-attn cannot run (the CPU tests do).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .metadata import (AttentionMetadata, BlocksOf, FixedTableMetadata, FlashMetadata,
                       ScheduledStep, block_table, common_fields)

PAGE_MULTIPLE = 256
"""flash-attn's paged kernels read pages of a multiple of this many tokens."""
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashFunctions:
    varlen: Callable
    """flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k, softmax_scale=, causal=, window_size=, block_table=)."""
    with_kvcache: Callable
    """flash_attn_with_kvcache(q [B, 1, H, D], k_cache, v_cache, cache_seqlens=,
    block_table=, softmax_scale=, causal=, window_size=)."""


def load_flash_functions() -> FlashFunctions | None:
    """flash-attn's two paged entry points, or None when it is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError:
        return None
    return FlashFunctions(flash_attn_varlen_func, flash_attn_with_kvcache)


PAGED_VARLEN_VERSION = (2, 5, 7)
"""flash-attn's first release whose flash_attn_varlen_func takes a block_table."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def flash_unsupported_reason(device: torch.device, cache_dtype: torch.dtype,
                             page_size: int | None, head_dim: int | None = None) -> str | None:
    """Why the flash backend cannot serve this setup, or None when it can (None for
    page_size or head_dim: not known yet, not checked)."""
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    if cache_dtype not in FLASH_DTYPES:
        return f"flash-attn needs a float16 or bfloat16 KV cache, not {cache_dtype}"
    if page_size is not None and page_size % PAGE_MULTIPLE:
        return f"flash-attn's paged kernels need page_size a multiple of {PAGE_MULTIPLE}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        # other sizes are padded: a copy of the whole paged cache per call
        return f"flash-attn serves head sizes that are multiples of 8 up to 256, not {head_dim}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "flash-attn 2 needs a GPU of compute capability 8.0 or newer"
    if load_flash_functions() is None:
        return "flash-attn is not installed"
    import flash_attn
    if _version(getattr(flash_attn, "__version__", "0")) < PAGED_VARLEN_VERSION:
        return "flash-attn older than 2.5.7 has no paged varlen attention"
    return None


class FlashPagedAttention:
    name = "flash"
    needs_block_tables = True
    """The engine builds FlashMetadata (block tables) for this backend's varlen steps."""

    @staticmethod
    def decode_fast_path_on(device: torch.device) -> bool:
        """flash_attn_with_kvcache serves decode-only steps wherever this backend runs."""
        return True

    @staticmethod
    def metadata_builder(page_size: int, step_queries: bool = False) -> "FlashMetadataBuilder":
        """Its varlen steps read block tables (FlashMetadata); the native CPU kernel's
        per-row queries are not for it."""
        return FlashMetadataBuilder(page_size)

    @staticmethod
    def decode_gather(seq_lens, block_table, page_size, window, dtype) -> None:
        """flash_attn_with_kvcache reads the block table itself."""
        return None

    def __init__(self, functions: FlashFunctions | None = None) -> None:
        functions = functions or load_flash_functions()
        if functions is None:
            raise RuntimeError("the flash attention backend needs flash-attn installed")
        self.functions = functions

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, cache_written: bool = False) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D]; caches [num_blocks, page_size, KVH, D]
        -> [T, H, D]. Reads FlashMetadata (built when the engine sees
        `needs_block_tables`) or, on the decode fast path, FixedTableMetadata."""
        if not isinstance(meta, (FlashMetadata, FixedTableMetadata)):
            raise TypeError(f"flash attention reads block tables (FlashMetadata or "
                            f"FixedTableMetadata), got {type(meta).__name__}: the step was "
                            f"built for a backend without them")
        if not cache_written:
            num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
            key_cache.view(-1, num_kv_heads, head_dim).index_copy_(
                0, meta.slot_mapping, key.to(key_cache.dtype))
            value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
                0, meta.slot_mapping, value.to(value_cache.dtype))
        window = (-1, -1) if meta.window is None else (meta.window - 1, 0)
        q = query.to(key_cache.dtype)
        if isinstance(meta, FixedTableMetadata):
            out = self.functions.with_kvcache(
                q.unsqueeze(1), key_cache, value_cache, cache_seqlens=meta.seq_lens_k,
                block_table=meta.block_table, softmax_scale=scale, causal=True,
                window_size=window)                                   # [B, 1, H, D]
            return out.squeeze(1).to(query.dtype)
        out = self.functions.varlen(
            q, key_cache, value_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=scale, causal=True,
            window_size=window, block_table=meta.block_table)        # [T, H, D]
        return out.to(query.dtype)


@dataclass(frozen=True)
class FlashMetadataBuilder:
    """A varlen step of a backend that pages through block tables: the tables padded
    to the widest request, and the cumulative context lengths."""
    page_size: int

    def build(self, batch: ScheduledStep, window: int | None, blocks_of: BlocksOf,
              device: torch.device) -> FlashMetadata:
        lengths = [e.end for e in batch.entries]
        return FlashMetadata(
            **common_fields(batch, self.page_size, device, window, blocks_of),
            block_table=block_table(batch, blocks_of, None, device),
            cu_seqlens_k=torch.tensor(list(itertools.accumulate(lengths, initial=0)),
                                      dtype=torch.int32, device=device),
            max_seqlen_q=max(e.num_tokens for e in batch.entries), max_seqlen_k=max(lengths))

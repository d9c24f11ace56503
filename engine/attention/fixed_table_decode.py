"""Decode attention over fixed-width block tables in plain torch ops: the decode fast
path of the torch backend on accelerators without flash-attn.

The torch backend's usual decode gathers each request's context padded to the
step's longest one, a shape that changes every step, and so no CUDA graph could
replay it. Here the shapes depend only on the number of requests B and the table
width W (max_blocks_per_request): every request gathers all W pages of its table
and a mask keeps its real keys.

    block_table [B, W] -> keys [B, W * page_size, KVH, D]
    key j of request b is real when j < seq_lens[b] (and, with a window,
    j > seq_lens[b] - 1 - window)

It reads W * page_size keys per request whatever their real length, which costs
bandwidth on long tables; what it buys is a decode step without host
synchronisation or changing shapes, so graphs can replay it (cuda_graphs.py).
Pages past a request's length are whatever the table's padding block 0 holds, or a
stale page: masked, and finite because accelerator caches start zeroed
(paged_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TableGather:
    """What every layer of one decode step gathers and masks by: the same for all
    layers of an attention group, so built once per step with the tables
    (FixedTableMetadata.gather) instead of in every layer (its indices and mask took four kernels a layer, and SDPA
    turns a bool mask into an additive one with three more on every call)."""

    blocks: torch.Tensor       # [B, W] long: the block table as gather indices
    mask: torch.Tensor         # [B, 1, 1, W * page_size]: 0 on a row's real keys, else -inf


def table_gather(seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int,
                 dtype: torch.dtype, window: int | None = None) -> TableGather:
    """seq_lens [B] int32, block_table [B, W] int32 -> the step's TableGather, its mask
    in `dtype` (the attention's: SDPA adds it to the scores as it would the bool mask
    it converts, so the result is the same bit for bit)."""
    key_pos = torch.arange(block_table.shape[1] * page_size,
                           device=block_table.device)[None, :]                # [1, L]
    lengths = seq_lens.long()[:, None]                                        # [B, 1]
    visible = key_pos < lengths                                               # [B, L]
    if window is not None:
        visible &= key_pos > lengths - 1 - window
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, float("-inf"))
    return TableGather(block_table.long(), mask[:, None, None, :])


def attention_dtype(query: torch.Tensor, key_cache: torch.Tensor) -> torch.dtype:
    """The dtype the attention runs in: the wider of the query's and the cache's."""
    return torch.promote_types(query.dtype, key_cache.dtype)


def fixed_table_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                       window: int | None = None, gather: TableGather | None = None
                       ) -> torch.Tensor:
    """query [B, H, D] (one token per request, at position seq_lens - 1); caches
    [num_blocks, page_size, KVH, D]; seq_lens [B] int32; block_table [B, W] int32
    -> [B, H, D] in query's dtype, computed in the wider of query's and the cache's.
    `gather`: this step's table_gather(seq_lens, block_table, page_size,
    attention_dtype(query, key_cache), window), when the caller keeps one per step."""
    batch, width = block_table.shape
    page_size, num_kv_heads, head_dim = key_cache.shape[1:]
    dtype = attention_dtype(query, key_cache)
    if gather is None:
        gather = table_gather(seq_lens, block_table, page_size, dtype, window)
    group = query.shape[1] // num_kv_heads
    keys = key_cache[gather.blocks].view(batch, width * page_size, num_kv_heads, head_dim)
    values = value_cache[gather.blocks].view(batch, width * page_size, num_kv_heads, head_dim)
    # the G query heads of a KV head as G query rows of it: no K/V repeated per head
    # (SDPA's GQA option would copy them, and its kernels with a mask lack it)
    out = F.scaled_dot_product_attention(
        query.to(dtype).reshape(batch, num_kv_heads, group, head_dim),        # [B, KVH, G, D]
        keys.to(dtype).transpose(1, 2), values.to(dtype).transpose(1, 2),     # [B, KVH, L, D]
        attn_mask=gather.mask, scale=scale)                                   # [B, KVH, G, D]
    return out.reshape(batch, num_kv_heads * group, head_dim).to(query.dtype)

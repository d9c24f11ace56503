"""Paged attention with plain torch ops: works on any device.

Per layer: scatter the step's new K/V into the cache pages (one index_copy_), then
- decode requests (one query each) are batched into a single SDPA call over their
  contexts gathered from the pages and padded to the longest, with a padding mask;
- each prefill chunk runs its own SDPA call: over its fresh K/V when it starts at
  position 0 (plain causal), else over its whole context gathered from the pages with
  a causal mask shifted by the tokens already cached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


class TorchPagedAttention:
    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)      # [num_blocks*page, KVH, D]
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        flat_keys.index_copy_(0, meta.slot_mapping, key.to(flat_keys.dtype))
        flat_values.index_copy_(0, meta.slot_mapping, value.to(flat_values.dtype))

        output = torch.empty_like(query)                            # [T, H, D]
        if meta.decode_rows is not None:
            output[meta.decode_rows] = self._decode(query, flat_keys, flat_values, meta, scale)
        for chunk in meta.prefills:
            output[chunk.q_start:chunk.q_end] = self._prefill(
                query, key, value, flat_keys, flat_values, chunk, scale)
        return output

    @staticmethod
    def _decode(query, flat_keys, flat_values, meta: AttentionMetadata, scale: float):
        q = query[meta.decode_rows].unsqueeze(2)                    # [B, H, 1, D]
        k = flat_keys[meta.decode_kv_slots].transpose(1, 2)         # [B, KVH, L, D]
        v = flat_values[meta.decode_kv_slots].transpose(1, 2)
        k, v = k.to(q.dtype), v.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)                                       # [B, H, D]

    @staticmethod
    def _prefill(query, key, value, flat_keys, flat_values, chunk, scale: float):
        q = query[chunk.q_start:chunk.q_end].transpose(0, 1).unsqueeze(0)   # [1, H, n, D]
        if chunk.kv_slots is None:
            k = key[chunk.q_start:chunk.q_end]                              # [n, KVH, D]
            v = value[chunk.q_start:chunk.q_end]
        else:
            k = flat_keys[chunk.kv_slots].to(q.dtype)                       # [start+n, KVH, D]
            v = flat_values[chunk.kv_slots].to(q.dtype)
        k = k.transpose(0, 1).unsqueeze(0)                                  # [1, KVH, L, D]
        v = v.transpose(0, 1).unsqueeze(0)
        if chunk.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale,
                                                 enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)                               # [n, H, D]

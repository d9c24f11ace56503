"""Paged attention with plain torch ops: works on any device.

Per layer: scatter the step's new K/V into the cache pages (one index_copy_), then,
on a CPU fp32 or bf16 cache with the native kernels, one kernel call reads every
row's context in place (engine/kernels/paged_attention.c): decode rows and, in full
attention layers, the rows of prefill chunks too (query i of a chunk over its
request's first start + i + 1 slots). Otherwise:
- decode requests (one query each) are batched over their contexts gathered from the
  pages and padded to the longest, with a padding mask (one SDPA call for a few
  requests, per-KV-head matmuls for many);
- each prefill chunk runs its own call: on a bf16 CPU cache the native flash-style
  kernel over the pages in place (native_prefill.py); otherwise SDPA, over its fresh
  K/V when it starts at position 0 (plain causal), else over its whole context
  gathered from the pages with a causal mask shifted by the tokens already cached.
Decode steps on the decode fast path (accelerators: FixedTableMetadata) read
fixed-width block tables instead (fixed_table_decode.py), the shapes CUDA graphs need;
every other step arrives as TorchMetadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fixed_table_decode import TableGather, attention_dtype, fixed_table_decode, table_gather
from .metadata import AttentionMetadata, FixedTableMetadata, TorchMetadata
from .native_prefill import attend_chunk, prefill_kernels
from .torch_metadata import TorchMetadataBuilder

FUSED_DECODE_MAX_BATCH = 4
"""Decode batches up to this size take one SDPA call; larger ones the per-KV-head
matmuls, which gather and multiply faster once the contexts are many."""


def _native_kernels(flat_keys: torch.Tensor):
    """The native decode-attention kernel for an fp32 or bf16 cache on the CPU, else None."""
    if flat_keys.dtype not in (torch.float32, torch.bfloat16) or flat_keys.device.type != "cpu" \
            or not flat_keys.is_contiguous():
        return None
    from ..kernels import default_kernels
    return default_kernels()


class TorchPagedAttention:
    name = "torch"
    needs_block_tables = False

    @staticmethod
    def decode_fast_path_on(device: torch.device) -> bool:
        """Accelerators take decode steps over fixed-width tables (fixed_table_decode.py),
        which CUDA graphs can replay; the CPU keeps its native kernel's decode."""
        return device.type != "cpu"

    @staticmethod
    def metadata_builder(page_size: int, step_queries: bool = False) -> TorchMetadataBuilder:
        """Its varlen steps read TorchMetadata; `step_queries`: the native kernel serves
        the head size (torch_metadata.py)."""
        return TorchMetadataBuilder(page_size, step_queries)

    @staticmethod
    def decode_gather(seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int,
                      window: int | None, dtype: torch.dtype) -> TableGather:
        """The fixed-table decode's gather indices and mask (fixed_table_decode.py)."""
        return table_gather(seq_lens, block_table, page_size, dtype, window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, cache_written: bool = False) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)      # [num_blocks*page, KVH, D]
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        if not cache_written:
            flat_keys.index_copy_(0, meta.slot_mapping, key.to(flat_keys.dtype))
            flat_values.index_copy_(0, meta.slot_mapping, value.to(flat_values.dtype))

        if isinstance(meta, FixedTableMetadata):     # graph-friendly shapes
            gather = meta.gather if meta.gather is not None else table_gather(
                meta.seq_lens_k, meta.block_table, key_cache.shape[1],
                attention_dtype(query, key_cache), meta.window)
            return fixed_table_decode(query, key_cache, value_cache, meta.seq_lens_k,
                                      meta.block_table, scale, meta.window, gather)
        if not isinstance(meta, TorchMetadata):
            raise TypeError(f"the torch backend reads TorchMetadata or FixedTableMetadata, "
                            f"got {type(meta).__name__}")
        return self._varlen(query, key, value, flat_keys, flat_values, meta, scale)

    def _varlen(self, query, key, value, flat_keys, flat_values, meta: TorchMetadata,
                scale: float) -> torch.Tensor:
        """Varlen steps (prefill chunks, CPU decodes). Under a compiled layer step this
        runs eagerly (compile_boundary)."""
        if not meta.prefills:                 # decode only: row d is decode request d
            return self._decode(query, flat_keys, flat_values, meta, scale)
        kernels = _native_kernels(flat_keys)
        if kernels is not None and meta.step_kv_slots is not None:
            # every row one query over its request's causal context (or its window's
            # part): one call per layer for all prefill chunks and decodes (not an SDPA
            # call per chunk)
            return kernels.paged_decode_attention(
                query.float(), flat_keys, flat_values, meta.step_kv_slots, meta.step_lengths,
                scale, slot_rows=meta.step_slot_rows, starts=meta.step_starts).to(query.dtype)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
        if meta.decode_rows is not None:
            output[meta.decode_rows] = self._decode(query, flat_keys, flat_values, meta, scale)
        prefill = prefill_kernels(flat_keys, flat_values, query) if meta.prefills else None
        for chunk in meta.prefills:
            if prefill is not None:
                attend_chunk(prefill, query, flat_keys, flat_values, chunk, meta, scale, output)
            else:
                output[chunk.q_start:chunk.q_end] = self._prefill(
                    query, key, value, flat_keys, flat_values, chunk, scale)
        return output

    @staticmethod
    def _decode(query, flat_keys, flat_values, meta: TorchMetadata, scale: float):
        """One query per request: the native kernel when there is one for this cache;
        else one SDPA call for a few requests; else batched matmuls over the gathered
        contexts, one pair per KV head. The G query heads sharing a KV head (GQA) form the rows of one
        matmul, so K/V are never repeated, and the strided per-head views of the
        gathered K/V go to the matmul without a copy. Computed in the wider of the
        cache's and the query's dtypes: a bf16 cache under fp32 activations is widened
        after the gather, so the arithmetic stays fp32 as with the kernel."""
        slots = meta.decode_kv_slots                                # [B, L]
        batch, length = slots.shape
        num_kv_heads, head_dim = flat_keys.shape[1], flat_keys.shape[2]
        group = query.shape[1] // num_kv_heads
        dtype = torch.promote_types(flat_keys.dtype, query.dtype)
        kernels = _native_kernels(flat_keys)
        if kernels is not None and meta.decode_lengths is not None:
            # decode-only steps: row d is request d, the query goes in as it is
            q = (query if not meta.prefills else query[meta.decode_rows]).float()  # [B, H, D]
            return kernels.paged_decode_attention(q, flat_keys, flat_values, slots,
                                                  meta.decode_lengths, scale).to(query.dtype)
        if batch <= FUSED_DECODE_MAX_BATCH:
            return TorchPagedAttention._decode_fused(query, flat_keys, flat_values, meta, scale)
        q = query[meta.decode_rows].to(dtype).view(batch, num_kv_heads, group, head_dim)
        k, v = _gather_contexts(flat_keys, flat_values, slots, dtype)   # [B, L, KVH, D] each
        padding = ~meta.decode_mask.view(batch, 1, length)          # [B, 1, L]
        # head-major output: each bmm writes a contiguous [B, G, D] slab (a strided
        # `out` would send bmm down a slow per-batch path)
        out = torch.empty(num_kv_heads, batch, group, head_dim, dtype=dtype, device=q.device)
        for head in range(num_kv_heads):
            scores = torch.bmm(q[:, head], k[:, :, head].transpose(1, 2)) * scale   # [B, G, L]
            probs = scores.masked_fill_(padding, float("-inf")).softmax(dim=-1)
            torch.bmm(probs, v[:, :, head], out=out[head])                        # [B, G, D]
        out = out.transpose(0, 1).reshape(batch, num_kv_heads * group, head_dim)  # [B, H, D]
        return out.to(query.dtype)

    @staticmethod
    def _decode_fused(query, flat_keys, flat_values, meta: TorchMetadata, scale: float):
        """Few decode requests: one SDPA call over the gathered contexts (per-op costs
        dominate here, and SDPA is one op where the per-head path is ~15)."""
        dtype = torch.promote_types(flat_keys.dtype, query.dtype)
        q = query[meta.decode_rows].to(dtype).unsqueeze(2)              # [B, H, 1, D]
        k, v = _gather_contexts(flat_keys, flat_values, meta.decode_kv_slots, dtype)
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=meta.decode_mask, scale=scale,
                                             enable_gqa=True)       # [B, H, 1, D]
        return out.squeeze(2).to(query.dtype)

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


def _gather_contexts(flat_keys: torch.Tensor, flat_values: torch.Tensor,
                     slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at `slots` [B, L] of the flat caches: [B, L, KVH, D] each, in
    `dtype`."""
    shape = (*slots.shape, flat_keys.shape[1], flat_keys.shape[2])
    return (flat_keys.index_select(0, slots.view(-1)).view(shape).to(dtype),
            flat_values.index_select(0, slots.view(-1)).view(shape).to(dtype))


_boundary_installed = False


def compile_boundary() -> None:
    """Run the varlen attention eagerly inside compiled layer steps, from now on, in
    this process (compile_paths.py calls it when a varlen path compiles). Its shape is
    Python, not tensors: how many prefill chunks, which start at position 0, which rows
    decode. A traced layer guards on all of it: a graph per kind of step, eight of them
    before torch stops compiling, a limit a short run of mixed prompts soon meets.
    Behind torch.compiler.disable, the layer's graphs end before it and start again
    after it, and one set serves every kind of step. Done on demand: the decorator
    imports dynamo, which would slow the start of an engine that compiles nothing."""
    global _boundary_installed
    if not _boundary_installed:
        TorchPagedAttention._varlen = torch.compiler.disable(TorchPagedAttention._varlen)
        _boundary_installed = True

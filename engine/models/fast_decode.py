"""One decoder layer of a decode step, straight through the native kernels.

At batch 1 a Llama layer costs ~0.4 ms, and a third of it is Python: module calls,
wrappers checking their inputs, small torch ops between the kernels. For layers whose
projections all run on GGUF blocks (models/block_weights.py), a decode-only step of
at most MAX_KERNEL_ROWS requests takes this path instead of the modules:

    h = rms_norm(x)                         torch (one op)
    q, k, v = split(qkv_kernel(h)); rotate q and k together
    write k, v to their cache slots         torch index_copy_
    a = attention_kernel(q, paged cache)    reads the pages in place
    x = x + o_kernel(a)
    x = x + gated_mlp_kernel(rms_norm(x))   one native call

The arithmetic is the modules' (same kernels, same order); only the calls around it
are fewer. Any other step (prefill rows, sliding layers, more rows, no kernels) returns
None and the modules run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .block_weights import MAX_KERNEL_ROWS, BlockLinear, FusedBlockMLP
from .layers import apply_rotary


class FastDecodeLayer:
    def __init__(self, layer: nn.Module, kernels) -> None:
        attn = layer.self_attn
        self.attn, self.mlp, self.kernels = attn, layer.mlp, kernels
        self.layer_idx = attn.layer_idx
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.split = [attn.q_size + attn.kv_size, attn.kv_size]
        self.heads = attn.num_heads + attn.num_kv_heads

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        """Llama-style layer (two plain RMSNorms, no q/k norm, full attention, no
        attention bias) whose projections and MLP all run on Q4_1 blocks."""
        attn = layer.self_attn
        return (getattr(attn, "q_norm", None) is None and not attn.is_sliding
                and all(isinstance(p, BlockLinear) and p.kind == "Q4_1" and p.bias is None
                        for p in (attn.qkv_proj, attn.o_proj))
                and isinstance(getattr(layer.mlp, "fused", None), FusedBlockMLP)
                and not layer.input_layernorm.offset
                and not layer.post_attention_layernorm.offset
                and not hasattr(layer, "pre_feedforward_layernorm"))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta) -> torch.Tensor | None:
        """The layer's output [T, hidden], or None when this step is not for it."""
        num_tokens = hidden.shape[0]
        if (meta.prefills or meta.decode_lengths is None or num_tokens > MAX_KERNEL_ROWS
                or hidden.dtype != torch.float32 or hidden.device.type != "cpu"):
            return None
        attn, kernels = self.attn, self.kernels
        key_cache = kv_cache.key_caches[self.layer_idx]
        value_cache = kv_cache.value_caches[self.layer_idx]
        if key_cache.dtype != torch.float32:
            return None
        first, second = self.norms
        h = F.rms_norm(hidden, first.weight.shape, first.weight, first.eps)
        qkv = kernels.gemm("Q4_1", h, attn.qkv_proj.codes, attn.qkv_proj.scales,
                           attn.qkv_proj.minima)                       # [T, q + 2 kv]
        qk, v = qkv.split(self.split, dim=-1)
        qk = apply_rotary(qk.reshape(num_tokens, self.heads, attn.head_dim), cos, sin)
        q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)   # [T, H, D], [T, KVH, D]
        flat_keys = key_cache.view(-1, attn.num_kv_heads, attn.head_dim)
        flat_values = value_cache.view(-1, attn.num_kv_heads, attn.head_dim)
        flat_keys.index_copy_(0, meta.slot_mapping, k)
        flat_values.index_copy_(0, meta.slot_mapping, v.view(num_tokens, attn.num_kv_heads, -1))
        context = kernels.paged_decode_attention(q, flat_keys, flat_values, meta.decode_kv_slots,
                                                 meta.decode_lengths, attn.scale)
        hidden = hidden + kernels.gemm("Q4_1", context.view(num_tokens, attn.q_size),
                                       attn.o_proj.codes, attn.o_proj.scales, attn.o_proj.minima)
        h = F.rms_norm(hidden, second.weight.shape, second.weight, second.eps)
        return hidden + kernels.gated_mlp(h, self.mlp.gate_up_proj, self.mlp.down_proj)

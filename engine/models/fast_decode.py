"""One decoder layer of a decode step, straight through the native kernels.

At batch 1 a Llama layer costs ~0.4 ms, and a third of it is Python: module calls,
wrappers checking their inputs, small torch ops between the kernels. For layers whose
projections all run on GGUF blocks (models/block_weights.py: any of the kernels'
kinds, one per projection or several, as in Q4_K_M and Q5_K_M files), a decode-only
step of at most the projections' `max_rows` requests (MAX_KERNEL_ROWS,
BF16_KERNEL_ROWS in dtype bf16-weights) takes this path instead of the modules:

    h = rms_norm(x)
    q, k, v = split(qkv_kernel(h) [+ qkv bias]); [q, k head norms]; rotate q and k
    write k, v to their cache slots
    a = attention_kernel(q, paged cache)    reads the pages in place
    x = x + o_kernel(a)
    x = x + gated_mlp_kernel(rms_norm(x))

The whole layer is two native calls (kernels/block_layers.py), `attention_half`
(norm, qkv, RoPE, cache write, attention, o_proj, residual) and `mlp_half` (norm,
gated MLP, residual), with the modules' arithmetic in the same order (the norm and
RoPE written in C; Qwen2's qkv bias added after the qkv kernel, as BlockLinear adds
it; Qwen3's head norms by the same C norm, summed in another order than torch's).
Any other step (prefill rows, more rows, a partial RoPE, sliding layers) returns
None and the modules run. When every layer of the model has one,
FastDecodeStack runs them all in one native call (decode_layer.c's
block_decoder_stack, the same halves in a C loop).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..kernels.block_layers import BlockStackLayer, attention_half, mlp_half, native_weight
from .block_weights import BlockLinear, FusedBlockMLP


class FastDecodeLayer:
    def __init__(self, layer: nn.Module, kernels) -> None:
        attn = layer.self_attn
        self.attn, self.mlp, self.kernels = attn, layer.mlp, kernels
        self.layer_idx = attn.layer_idx
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)
        self.head_norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        """Qwen3's RMSNorms of every q and k head, or (None, None)."""

    @property
    def max_rows(self) -> int:
        """Steps of at most this many rows are this path's: the least of the four
        projections' (a Q5_1 MLP stops at 12 rows where Q4_1 attention goes on)."""
        return min(p.max_rows for p in self.projections)

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        """Llama-style layer (two plain RMSNorms, full attention) whose projections
        and MLP all run on blocks, with no bias but an fp32 one on qkv (Qwen2's) and,
        if any, plain fp32 RMSNorms of the q and k heads (Qwen3's)."""
        attn = layer.self_attn
        qkv_bias = getattr(attn.qkv_proj, "bias", None)
        return (_head_norms_fit(getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
                and not attn.is_sliding
                and all(isinstance(p, BlockLinear) for p in (attn.qkv_proj, attn.o_proj))
                and attn.o_proj.bias is None
                and (qkv_bias is None or (qkv_bias.dtype == torch.float32
                                          and qkv_bias.device.type == "cpu"
                                          and qkv_bias.is_contiguous()))
                and isinstance(getattr(layer.mlp, "fused", None), FusedBlockMLP)
                and not layer.input_layernorm.offset
                and not layer.post_attention_layernorm.offset
                and not hasattr(layer, "pre_feedforward_layernorm"))

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta) -> torch.Tensor | None:
        """The layer's output [T, hidden], or None when this step is not for it."""
        attn = self.attn
        key_cache = kv_cache.key_caches[self.layer_idx]
        value_cache = kv_cache.value_caches[self.layer_idx]
        if not (_step_fits(meta, cos, sin, attn.head_dim) and hidden.dim() == 2
                and hidden.shape[0] == cos.shape[0] <= self.max_rows
                and _is_cpu_fp32(hidden)
                and key_cache.dtype == value_cache.dtype
                and key_cache.dtype in (torch.float32, torch.bfloat16)):
            return None
        first, second = self.norms
        flat_keys = key_cache.view(-1, attn.num_kv_heads, attn.head_dim)
        flat_values = value_cache.view(-1, attn.num_kv_heads, attn.head_dim)
        hidden = attention_half(
            self.kernels, hidden, first, attn.qkv_proj, attn.o_proj, cos, sin,
            meta.slot_mapping, flat_keys, flat_values, meta.decode_kv_slots,
            meta.decode_lengths, attn.num_heads, attn.scale, self.head_norms)
        return mlp_half(self.kernels, hidden, second, self.mlp.gate_up_proj,
                        self.mlp.down_proj)


def _head_norms_fit(q_norm, k_norm) -> bool:
    """No head norms, or a q and a k norm that block_attention_half runs: plain fp32
    RMSNorms (no Gemma offset) of one eps."""
    if q_norm is None or k_norm is None:
        return q_norm is None and k_norm is None
    return (not q_norm.offset and not k_norm.offset and q_norm.eps == k_norm.eps
            and all(_is_cpu_fp32(norm.weight) for norm in (q_norm, k_norm)))


_last_step: tuple = (None, False)
"""(metadata, verdict) of the last step checked: every layer of a step shares its
metadata and rotary tables, so _step_fits checks them once per step, not per layer.
Replaced as one tuple, so engines on other threads never read a mixed pair."""


def _is_cpu_fp32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


def _step_fits(meta, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """The step is decode-only and the tensors the native calls read for it are
    contiguous CPU fp32 (cos, sin [T, D]) or int64 (slots, lengths). Its size is
    checked per layer, against the layer's projections' `max_rows`."""
    global _last_step
    last_meta, verdict = _last_step
    if last_meta is meta:
        return verdict
    longs = (meta.slot_mapping, meta.decode_kv_slots, meta.decode_lengths)
    verdict = (not meta.prefills and meta.decode_lengths is not None
               and cos.shape == sin.shape == (cos.shape[0], head_dim)
               and _is_cpu_fp32(cos) and _is_cpu_fp32(sin)
               and all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous()
                       for t in longs))
    _last_step = (meta, verdict)
    return verdict


class FastDecodeStack:
    """Every FastDecodeLayer of the model in one call (the model's `layer_stacks`):
    the same steps, the same output, bit for bit (tests/engine/test_packed_stack.py)."""

    def __init__(self, layers: list[FastDecodeLayer], kernels) -> None:
        self.layers, self.kernels = layers, kernels
        self.function = kernels.library.block_decoder_stack
        self.entries = (BlockStackLayer * len(layers))(*(self._entry(layer) for layer in layers))
        self.max_rows = min(layer.max_rows for layer in layers)
        attn = layers[0].attn
        self.shape = (attn.o_proj.out_features, layers[0].mlp.gate_up_proj.out_features // 2,
                      attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
        self.bound = weakref.WeakKeyDictionary()
        """cache -> entries pointing at that cache (one array per cache: engines with
        caches of their own never share what a call reads)."""

    @staticmethod
    def _entry(layer: FastDecodeLayer) -> BlockStackLayer:
        first, second = layer.norms
        bias, (q_norm, k_norm) = layer.attn.qkv_proj.bias, layer.head_norms
        return BlockStackLayer(first.weight.data_ptr(), second.weight.data_ptr(), first.eps,
                               second.eps, *(native_weight(p) for p in layer.projections),
                               qkv_bias=None if bias is None else bias.data_ptr(),
                               q_norm=None if q_norm is None else q_norm.weight.data_ptr(),
                               k_norm=None if k_norm is None else k_norm.weight.data_ptr(),
                               qk_eps=0.0 if q_norm is None else q_norm.eps)

    @staticmethod
    def build(model: nn.Module, kernels) -> "FastDecodeStack | None":
        layers = [getattr(layer, "fast_decode", None) for layer in getattr(model, "layers", [])]
        if not layers or not all(isinstance(layer, FastDecodeLayer) for layer in layers) \
                or not hasattr(kernels, "library"):
            return None
        return FastDecodeStack(layers, kernels)

    def _bind(self, kv_cache):
        entries = self.bound.get(kv_cache)
        if entries is None:
            entries = (BlockStackLayer * len(self.layers))(*self.entries)       # copies
            for entry, layer in zip(entries, self.layers):
                entry.keys = kv_cache.key_caches[layer.layer_idx].data_ptr()
                entry.values = kv_cache.value_caches[layer.layer_idx].data_ptr()
            self.bound[kv_cache] = entries
        return entries

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta) -> torch.Tensor | None:
        """The last layer's output [T, hidden], or None when this step is not for it
        (FastDecodeLayer's conditions, checked once for all layers)."""
        hidden_size, inter, heads, kv_heads, dim, scale = self.shape
        keys, values = kv_cache.key_caches[0], kv_cache.value_caches[0]
        if not (_step_fits(meta, cos, sin, dim) and hidden.dim() == 2
                and hidden.shape[0] == cos.shape[0] <= self.max_rows and _is_cpu_fp32(hidden)
                and keys.dtype == values.dtype and keys.dtype in (torch.float32, torch.bfloat16)
                and all(c.is_contiguous() for c in (keys, values))):
            return None
        entries = self._bind(kv_cache)
        x = hidden.clone()
        slots = meta.decode_kv_slots
        status = self.function(
            entries, len(self.layers), hidden_size, inter, heads, kv_heads, dim, scale,
            int(keys.dtype == torch.bfloat16), x.data_ptr(), x.shape[0], cos.data_ptr(),
            sin.data_ptr(), meta.slot_mapping.data_ptr(), slots.data_ptr(),
            meta.decode_lengths.data_ptr(), slots.shape[1], self.kernels.num_threads)
        if status:
            raise RuntimeError(f"block_decoder_stack failed ({status})")
        return x

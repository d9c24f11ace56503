"""One decoder layer of a decode step, straight through the native kernels.

At batch 1 a Llama layer costs ~0.4 ms, and a third of it is Python: module calls,
wrappers checking their inputs, small torch ops between the kernels. For layers whose
projections all run on GGUF blocks (models/block_weights.py: any of the kernels'
kinds, one per projection or several, as in Q4_K_M and Q5_K_M files), a decode-only
step of at most the projections' `max_rows` requests (kernel_rows: PANEL_KERNEL_ROWS
on AVX2 and AVX-512 builds, else MAX_KERNEL_ROWS; BF16_KERNEL_ROWS in dtype
bf16-weights) takes this path instead of the modules:

    h = rms_norm(x)
    q, k, v = split(qkv_kernel(h) [+ qkv bias]); [q, k head norms]; rotate q and k
    write k, v to their cache slots
    a = attention_kernel(q, paged cache)    reads the pages in place
    x = x + [norm](o_kernel(a))
    x = x + [norm](gated_mlp_kernel(rms_norm(x)))

The whole layer is two native calls (kernels/block_layers.py's decoder_layer), the
attention half (norm, qkv, RoPE, cache write, attention, o_proj, residual) and the
MLP half (norm, gated MLP, residual), with the modules' arithmetic in the same order:
a Llama layer's output is the modules' bit for bit. The families' variants
(decode_layer.c): Qwen2's qkv bias, added after the qkv kernel as BlockLinear adds
it; Qwen3's head norms; Gemma 3's head norms, norms on the attention's and the MLP's
outputs, (1 + weight) norms and GELU-tanh; sliding-window layers (Gemma 3's local
ones, Mistral's), which read their group's contexts (`meta.sliding`) and, in Gemma 3,
their own rotary tables. Norms other than Llama's plain ones, and GELU, are written
in C where the modules run torch's ops, so those agree to float rounding. Any other
step (prefill rows, more rows, a partial RoPE) returns None and the modules run.
When every layer of the model has one, FastDecodeStack runs them all in one native
call (decode_layer.c's block_decoder_stack, the same halves in a C loop).
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from ..kernels.block_layers import (BlockStackGroup, BlockStackLayer, BlockStackShape,
                                    decoder_layer, native_weight)
from ..kernels.native import GATED_ACTIVATIONS, kernel_failure
from .block_weights import BlockLinear, FusedBlockMLP
from .packed_stack import FULL, SLIDING, layer_norms, norm_weight

SHARED_SIZES = ("num_heads", "num_kv_heads", "head_dim", "scale")
"""The attention sizes every layer of a FastDecodeStack shares (BlockStackShape)."""


class FastDecodeLayer:
    def __init__(self, layer: nn.Module, kernels) -> None:
        attn = layer.self_attn
        self.attn, self.mlp, self.kernels = attn, layer.mlp, kernels
        self.layer_idx = attn.layer_idx
        self.group = SLIDING if attn.is_sliding else FULL
        self.projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)
        self.norms = layer_norms(layer)
        """(before the attention, before the MLP, on the attention's output, on the
        MLP's output, per q head, per k head): packed_stack.layer_norms, None where the
        layer has no such norm."""
        self.head_norms = self.norms[4:]
        self.norm_weights = [norm_weight(norm) for norm in self.norms]
        """What rms_norm multiplies by (Gemma's 1 + weight), kept for the entry."""
        self.entry = self._entry()
        """The layer's BlockStackLayer, its cache fields left for _bind."""
        self.shape = BlockStackShape(
            attn.o_proj.out_features, layer.mlp.gate_up_proj.out_features // 2,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, 0,
            GATED_ACTIVATIONS[layer.mlp.fused.activation])
        self.bound = weakref.WeakKeyDictionary()
        """cache -> ([entry], shape) pointing at that cache, or None (_bound_to), as
        FastDecodeStack's."""

    def _entry(self) -> BlockStackLayer:
        weights = [None if w is None else w.data_ptr() for w in self.norm_weights]
        first, second, attn_out, _, q_norm, _ = self.norms
        bias = self.attn.qkv_proj.bias
        return BlockStackLayer(
            weights[0], weights[1], first.eps, second.eps,
            *(native_weight(p) for p in self.projections),
            qkv_bias=None if bias is None else bias.data_ptr(), q_norm=weights[4],
            k_norm=weights[5], qk_eps=0.0 if q_norm is None else q_norm.eps,
            attn_out_norm=weights[2], mlp_out_norm=weights[3],
            out_eps=0.0 if attn_out is None else attn_out.eps, group=self.group)

    @property
    def max_rows(self) -> int:
        """Steps of at most this many rows are this path's: the least of the four
        projections' (a Q5_1 MLP stops at 12 rows where Q4_1 attention goes on)."""
        return min(p.max_rows for p in self.projections)

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        """A layer whose projections and MLP all run on blocks, with no bias but an fp32
        one on qkv (Qwen2's), and fp32 norms the native halves run: the two before
        the attention and the MLP, any on their outputs (Gemma 3's, of one eps), any
        q and k head norms (both, of one eps)."""
        attn = layer.self_attn
        qkv_bias = getattr(attn.qkv_proj, "bias", None)
        first, second, attn_out, mlp_out, q_norm, k_norm = layer_norms(layer)
        return (all(isinstance(p, BlockLinear) for p in (attn.qkv_proj, attn.o_proj))
                and attn.o_proj.bias is None
                and (qkv_bias is None or _is_cpu_fp32(qkv_bias))
                and isinstance(getattr(layer.mlp, "fused", None), FusedBlockMLP)
                and all(norm is None or _is_cpu_fp32(norm.weight)
                        for norm in (first, second, attn_out, mlp_out, q_norm, k_norm))
                and _pair_fits(attn_out, mlp_out) and _pair_fits(q_norm, k_norm))

    def _bind(self, kv_cache) -> tuple | None:
        found = self.bound.get(kv_cache, False)
        if found is False:
            found = self.bound[kv_cache] = _bound_to(
                (BlockStackLayer * 1)(self.entry), [self.layer_idx], self.shape, kv_cache)
        return found

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta) -> torch.Tensor | None:
        """The layer's output [T, hidden], or None when this step is not for it.
        cos, sin: this layer's rotary tables; meta: the step's (full group's)
        metadata, whose `sliding` a sliding layer reads."""
        group_meta = meta.sliding if self.group == SLIDING else meta
        if not (group_meta is not None and hidden.dim() == 2
                and hidden.shape[0] <= self.max_rows and _is_cpu_fp32(hidden)
                and _step_fits(group_meta, cos, sin, hidden.shape[0], self.attn.head_dim)):
            return None
        bound = self._bind(kv_cache)
        if bound is None:
            return None
        entries, shape = bound
        return decoder_layer(self.kernels, hidden, entries[0], shape,
                             _group(group_meta, cos, sin))


def _pair_fits(one, other) -> bool:
    """Both norms or neither; when both, of one eps (the entry holds one)."""
    if one is None or other is None:
        return one is None and other is None
    return one.eps == other.eps


def _is_cpu_fp32(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


def _bound_to(entries, layer_indices: list[int], shape: BlockStackShape,
              kv_cache) -> tuple | None:
    """Copies of `entries` (one per layer of layer_indices) pointing at those layers'
    caches, and of `shape` with the caches' dtype; None where the caches are not all
    contiguous and all fp32 or all bf16. Built once per cache (a cache keeps its
    tensors), so steps check nothing of it."""
    caches = [cache for i in layer_indices
              for cache in (kv_cache.key_caches[i], kv_cache.value_caches[i])]
    if not (len({c.dtype for c in caches}) == 1
            and caches[0].dtype in (torch.float32, torch.bfloat16)
            and all(c.is_contiguous() for c in caches)):
        return None
    entries = (BlockStackLayer * len(entries))(*entries)                 # copies
    for entry, index in zip(entries, layer_indices):
        keys = kv_cache.key_caches[index]                 # [num_blocks, page, KVH, D]
        entry.keys, entry.values = keys.data_ptr(), kv_cache.value_caches[index].data_ptr()
        entry.num_slots = keys.shape[0] * keys.shape[1]
    shape = BlockStackShape.from_buffer_copy(shape)
    shape.kv_bf16 = int(caches[0].dtype == torch.bfloat16)
    return entries, shape


_recent: tuple = ()
"""((metadata, verdict), ...) of the last two group metadatas checked: every layer of
a step shares the metadata and rotary tables of its group, so _step_fits checks each
group once per step, not per layer. Replaced as one tuple, so engines on other
threads never read a mixed pair."""


def _step_fits(meta, cos: torch.Tensor, sin: torch.Tensor, rows: int, head_dim: int) -> bool:
    """The group's step is decode-only, `rows` rows, and the tensors the native calls
    read for it are contiguous CPU fp32 (cos, sin [T, D]) or int64 (slots, lengths)."""
    global _recent
    for last_meta, verdict in _recent:
        if last_meta is meta:
            return verdict and cos.shape[0] == rows
    longs = (meta.slot_mapping, meta.decode_kv_slots, meta.decode_lengths)
    verdict = (not meta.prefills and meta.decode_lengths is not None
               and cos.shape == sin.shape == (cos.shape[0], head_dim)
               and _is_cpu_fp32(cos) and _is_cpu_fp32(sin)
               and all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous()
                       for t in longs)
               and meta.decode_kv_slots.shape[0] == meta.decode_lengths.shape[0] == cos.shape[0])
    _recent = ((meta, verdict),) + _recent[:1]
    return verdict and cos.shape[0] == rows


def _group(meta, cos: torch.Tensor, sin: torch.Tensor) -> BlockStackGroup:
    slots = meta.decode_kv_slots
    return BlockStackGroup(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                           slots.data_ptr(), meta.decode_lengths.data_ptr(), slots.shape[1])


class FastDecodeStack:
    """Every FastDecodeLayer of the model in one call (the model's `layer_stacks`):
    the same steps, the same output, bit for bit (tests/engine/test_packed_stack.py)."""

    def __init__(self, layers: list[FastDecodeLayer], kernels) -> None:
        self.layers, self.kernels = layers, kernels
        self.function = kernels.library.block_decoder_stack
        self.entries = (BlockStackLayer * len(layers))(*(layer.entry for layer in layers))
        self.shape = layers[0].shape
        self.max_rows = min(layer.max_rows for layer in layers)
        self.layer_indices = [layer.layer_idx for layer in layers]
        self.groups = sorted({layer.group for layer in layers})
        """The attention groups the layers read (FULL, SLIDING)."""
        self.bound = weakref.WeakKeyDictionary()
        """cache -> (entries, shape) pointing at that cache, or None where its tensors
        do not fit (_bound_to; one pair per cache: engines with caches of their own
        never share what a call reads)."""

    @staticmethod
    def build(model: nn.Module, kernels) -> "FastDecodeStack | None":
        """A stack when every layer has a FastDecodeLayer and they share their sizes
        and activation."""
        layers = [getattr(layer, "fast_decode", None) for layer in getattr(model, "layers", [])]
        if not layers or not all(isinstance(layer, FastDecodeLayer) for layer in layers) \
                or not hasattr(kernels, "library"):
            return None
        first = layers[0]
        if any(bytes(layer.shape) != bytes(first.shape) for layer in layers):
            return None
        return FastDecodeStack(layers, kernels)

    def _bind(self, kv_cache) -> tuple | None:
        found = self.bound.get(kv_cache, False)
        if found is False:
            found = self.bound[kv_cache] = _bound_to(self.entries, self.layer_indices,
                                                     self.shape, kv_cache)
        return found

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta, sliding_rope: tuple | None = None) -> torch.Tensor | None:
        """The last layer's output [T, hidden], or None when this step is not for it
        (FastDecodeLayer's conditions, checked once for all layers). cos, sin: the
        rotary tables of the full-attention layers (of every layer without
        `sliding_rope`); sliding_rope: Gemma 3's (cos, sin) of its local layers."""
        rows = hidden.shape[0]
        if not (hidden.dim() == 2 and rows <= self.max_rows and _is_cpu_fp32(hidden)):
            return None
        groups = (BlockStackGroup * 2)()
        for group in self.groups:
            group_meta = meta if group == FULL else meta.sliding
            group_cos, group_sin = (cos, sin) if group == FULL or sliding_rope is None \
                else sliding_rope
            if group_meta is None or not _step_fits(group_meta, group_cos, group_sin, rows,
                                                    self.shape.dim):
                return None
            groups[group] = _group(group_meta, group_cos, group_sin)
        bound = self._bind(kv_cache)
        if bound is None:
            return None
        entries, shape = bound
        x = hidden.clone()
        status = self.function(entries, len(self.layers), ctypes.byref(shape), groups,
                               len(groups), x.data_ptr(), rows, self.kernels.num_threads)
        if status:
            raise kernel_failure("block_decoder_stack", status)
        return x

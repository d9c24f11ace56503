"""One decoder layer of a decode step, straight through the native kernels.

At batch 1 much of a Llama layer's time is Python: module calls, wrappers checking
their inputs, small torch ops between the kernels. For layers whose projections
all run on GGUF blocks (models/block_weights.py: any of the kernels'
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

from ..attention.metadata import TorchMetadata
from ..kernels.block_layers import (BlockStackGroup, BlockStackLayer, BlockStackShape,
                                    decoder_layer)
from ..kernels.native import GATED_ACTIVATIONS, kernel_failure
from .block_weights import BlockLinear, FusedBlockMLP
from .executors import LayerStep, ModelStep
from .layer_spec import FULL, SLIDING, native_traits, norms_fit_native


class FastDecodeLayer:
    """A layer executor (executors.py) for decode steps on GGUF blocks."""

    def __init__(self, layer: nn.Module, kernels) -> None:
        attn = layer.self_attn
        self.attn, self.kernels = attn, kernels
        self.layer_idx = attn.layer_idx
        self.projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)
        self.traits = native_traits(layer, layer.spec, self.layer_idx)
        """The layer's norms, eps, qkv bias and group, as the native struct holds them."""
        self.group = self.traits.struct.group
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
        qkv, o, gate_up, down = (p.native_weight for p in self.projections)
        return BlockStackLayer(traits=self.traits.struct, qkv=qkv, o=o, gate_up=gate_up,
                               down=down)

    @property
    def max_rows(self) -> int:
        """Steps of at most this many rows are this path's: the least of the four
        projections' (a Q5_1 MLP stops at 12 rows where Q4_1 attention goes on)."""
        return min(p.max_rows for p in self.projections)

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        """A layer whose projections and MLP all run on blocks, with no bias but an fp32
        one on qkv (Qwen2's), and norms the native struct holds (norms_fit_native)."""
        attn = layer.self_attn
        return (isinstance(attn.qkv_proj, BlockLinear) and isinstance(attn.o_proj, BlockLinear)
                and attn.o_proj.bias is None
                and all(p.native_weight is not None for p in (
                    attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
                and (attn.qkv_proj.bias is None or _is_cpu_fp32(attn.qkv_proj.bias))
                and isinstance(layer.mlp.fused, FusedBlockMLP)
                and norms_fit_native(layer, layer.spec))

    def _bind(self, kv_cache) -> tuple | None:
        found = self.bound.get(kv_cache, False)
        if found is False:
            found = self.bound[kv_cache] = _bound_to(
                (BlockStackLayer * 1)(self.entry), [self.layer_idx], self.shape, kv_cache)
        return found

    def _group_meta(self, step: LayerStep):
        return step.meta.sliding if self.group == SLIDING else step.meta

    def fits(self, step: LayerStep) -> bool:
        """A decode-only step of at most max_rows fp32 rows whose tensors the native
        calls read (_step_fits), on a cache of one fp32 or bf16 layout."""
        hidden, group_meta = step.hidden, self._group_meta(step)
        return (group_meta is not None and hidden.dim() == 2
                and hidden.shape[0] <= self.max_rows and _is_cpu_fp32(hidden)
                and _step_fits(group_meta, step.cos, step.sin, hidden.shape[0],
                               self.attn.head_dim)
                and self._bind(step.kv_cache) is not None)

    def run(self, step: LayerStep) -> torch.Tensor:
        """The layer's output [T, hidden]."""
        entries, shape = self._bind(step.kv_cache)
        return decoder_layer(self.kernels, step.hidden, entries[0], shape,
                             _group(self._group_meta(step), step.cos, step.sin))


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


def _step_fits(meta, cos: torch.Tensor, sin: torch.Tensor, rows: int, head_dim: int) -> bool:
    """The group's step is decode-only, `rows` rows, and the tensors the native calls
    read for it are contiguous CPU fp32 (cos, sin [T, D]) or int64 (slots, lengths)."""
    return (isinstance(meta, TorchMetadata) and not meta.prefills
            and meta.decode_lengths is not None and cos.shape[0] == rows
            and cos.shape == sin.shape == (rows, head_dim)
            and _is_cpu_fp32(cos) and _is_cpu_fp32(sin)
            and all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous()
                    for t in (meta.slot_mapping, meta.decode_kv_slots, meta.decode_lengths))
            and meta.decode_kv_slots.shape[0] == meta.decode_lengths.shape[0] == rows)


def _group(meta, cos: torch.Tensor, sin: torch.Tensor) -> BlockStackGroup:
    slots = meta.decode_kv_slots
    return BlockStackGroup(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                           slots.data_ptr(), meta.decode_lengths.data_ptr(), slots.shape[1])


class FastDecodeStack:
    """Every FastDecodeLayer of the model in one call (a whole-stack executor): the
    same steps, the same output, bit for bit (tests/engine/test_packed_stack.py)."""

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
    def build(layers: list, kernels) -> "FastDecodeStack | None":
        """A stack when every layer has a FastDecodeLayer (`layers`: each layer's, or
        None) and they share their sizes and activation."""
        if not layers or not all(isinstance(layer, FastDecodeLayer) for layer in layers):
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

    def _group_views(self, step: ModelStep):
        """(group, metadata, cos, sin) of each attention group the layers read."""
        for group in self.groups:
            if group == FULL or step.sliding_rope is None:
                cos, sin = step.cos, step.sin
            else:
                cos, sin = step.sliding_rope
            yield group, step.meta if group == FULL else step.meta.sliding, cos, sin

    def fits(self, step: ModelStep) -> bool:
        """FastDecodeLayer's conditions, checked once for all layers."""
        hidden = step.hidden
        rows = hidden.shape[0]
        if not (hidden.dim() == 2 and rows <= self.max_rows and _is_cpu_fp32(hidden)):
            return False
        return all(meta is not None and _step_fits(meta, cos, sin, rows, self.shape.dim)
                   for _, meta, cos, sin in self._group_views(step)) \
            and self._bind(step.kv_cache) is not None

    def run(self, step: ModelStep) -> torch.Tensor:
        """The last layer's output [T, hidden]."""
        groups = (BlockStackGroup * 2)()
        for group, meta, cos, sin in self._group_views(step):
            groups[group] = _group(meta, cos, sin)
        entries, shape = self._bind(step.kv_cache)
        x = step.hidden.clone()
        status = self.function(entries, len(self.layers), ctypes.byref(shape), groups,
                               len(groups), x.data_ptr(), x.shape[0], self.kernels.num_threads)
        if status:
            raise kernel_failure("block_decoder_stack", status)
        return x

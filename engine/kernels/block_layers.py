"""The native halves of a decoder layer on GGUF blocks (decode_layer.c, block_mlp.c),
for projections of any block kind: the ctypes mirrors of kernels.h's BlockWeight and
of decode_layer.c's structs (a layer's weights and caches, the model's sizes, one
attention group's view of a step), and the calls that take them.

A projection (models/block_weights.py's BlockLinear) reaches C as one BlockWeight:
its parts in row order, each a kind, a column count and the pointers to its codes,
scales and minima. A Q4_1 file's qkv weight is one part; a Q4_K_M file's is two
(q and k in Q4_K read as Q4_1, v in Q6_K read as Q8_16), written each into its own
columns of the output, as BlockLinear.forward writes them. The struct is built once
per projection when the projection is made (`native_weight`); it points into the
projection's buffers, which live as long as the projection.
"""

from __future__ import annotations

import ctypes

import torch

from .native import BLOCK_KINDS, kernel_failure

MAX_WEIGHT_PARTS = 4
"""kernels.h's MAX_WEIGHT_PARTS."""


class BlockPart(ctypes.Structure):        # kernels.h's BlockPart
    _fields_ = [("kind", ctypes.c_int64), ("columns", ctypes.c_int64), ("q", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p)]


class BlockWeight(ctypes.Structure):      # kernels.h's BlockWeight
    _fields_ = [("num_parts", ctypes.c_int64), ("parts", BlockPart * MAX_WEIGHT_PARTS)]


class LayerTraits(ctypes.Structure):      # kernels.h's LayerTraits
    """A layer's family traits as every native layer struct holds them (filled by
    models/layer_spec.py's native_traits)."""
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float),
                ("attn_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("out_eps", ctypes.c_float), ("group", ctypes.c_int)]


class BlockStackShape(ctypes.Structure):  # decode_layer.c's BlockStackShape
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("dim", ctypes.c_int64), ("scale", ctypes.c_float), ("kv_bf16", ctypes.c_int),
                ("activation", ctypes.c_int)]


class BlockStackGroup(ctypes.Structure):  # decode_layer.c's BlockStackGroup
    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("width", ctypes.c_int64)]


class BlockStackLayer(ctypes.Structure):  # decode_layer.c's BlockStackLayer
    _fields_ = [("traits", LayerTraits),
                ("qkv", BlockWeight), ("o", BlockWeight), ("gate_up", BlockWeight),
                ("down", BlockWeight), ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("num_slots", ctypes.c_int64)]


def native_weight(parts) -> BlockWeight | None:
    """The BlockWeight of a projection's block parts (BlockLinear.parts, in row
    order), or None for more parts than the struct holds. It points into the parts'
    tensors: the caller keeps them alive as long as the struct."""
    if len(parts) > MAX_WEIGHT_PARTS:
        return None
    weight = BlockWeight(len(parts))
    for slot, part in zip(weight.parts, parts):
        slot.kind, slot.columns = BLOCK_KINDS[part.kind], part.codes.shape[0]
        slot.q, slot.d = part.codes.data_ptr(), part.scales.data_ptr()
        slot.m = None if part.minima is None else part.minima.data_ptr()
    return weight


def _check(status: int, name: str) -> None:
    if status:
        raise kernel_failure(name, status)


def gated_mlp(kernels, x: torch.Tensor, gate_up, down, activation: int) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) in one call; x [rows, K] fp32 contiguous; `gate_up`
    ([2I, K], gate rows first) and `down` ([N, I]) are BlockLinears without bias, of
    any kinds; activation: a native.GATED_ACTIVATIONS code -> [rows, N]."""
    rows, in_features = x.shape
    y = torch.empty(rows, down.out_features, dtype=torch.float32)
    _check(kernels.library.blocks_gated_mlp(
        x.data_ptr(), rows, in_features, ctypes.addressof(gate_up.native_weight),
        gate_up.out_features // 2, ctypes.addressof(down.native_weight), down.out_features,
        activation, y.data_ptr(), kernels.num_threads), "blocks_gated_mlp")
    return y


def decoder_layer(kernels, x: torch.Tensor, layer: BlockStackLayer, shape: BlockStackShape,
                  group: BlockStackGroup) -> torch.Tensor:
    """One decoder layer of a decode step of T requests in two native calls
    (decode_layer.c's halves): x + [norm](o_proj(attention(...))), writing their new
    K/V into the layer's caches first, then that + [norm](mlp(rms_norm(...))).
    x [T, hidden]; `layer` points at the layer's weights and caches, `group` at the
    step's tensors of its attention group. The caller guarantees fp32, CPU,
    contiguous tensors (models/fast_decode.py's FastDecodeLayer)."""
    tokens, hidden = x.shape
    attended = torch.empty(tokens, hidden, dtype=torch.float32)
    _check(kernels.library.block_attention_half(
        ctypes.byref(layer), ctypes.byref(shape), ctypes.byref(group), x.data_ptr(), tokens,
        attended.data_ptr(), kernels.num_threads), "block_attention_half")
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    _check(kernels.library.block_mlp_half(
        ctypes.byref(layer), ctypes.byref(shape), attended.data_ptr(), tokens, y.data_ptr(),
        kernels.num_threads), "block_mlp_half")
    return y

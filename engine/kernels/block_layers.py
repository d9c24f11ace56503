"""The native halves of a decoder layer on GGUF blocks (decode_layer.c, block_mlp.c),
for projections of any block kind: the ctypes mirror of kernels.h's BlockWeight and
the calls that take it.

A projection (models/block_weights.py's BlockLinear) reaches C as one BlockWeight:
its parts in row order, each a kind, a column count and the pointers to its codes,
scales and minima. A Q4_1 file's qkv weight is one part; a Q4_K_M file's is two
(q and k in Q4_K read as Q4_1, v in Q6_K read as Q8_16), written each into its own
columns of the output, as BlockLinear.forward writes them. The struct is built once
per projection and kept on it (`native_weight`); it points into the projection's
buffers, which live as long as the projection.
"""

from __future__ import annotations

import ctypes

import torch

from .native import BLOCK_KINDS

MAX_WEIGHT_PARTS = 4
"""kernels.h's MAX_WEIGHT_PARTS."""


class BlockPart(ctypes.Structure):        # kernels.h's BlockPart
    _fields_ = [("kind", ctypes.c_int64), ("columns", ctypes.c_int64), ("q", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("m", ctypes.c_void_p)]


class BlockWeight(ctypes.Structure):      # kernels.h's BlockWeight
    _fields_ = [("num_parts", ctypes.c_int64), ("parts", BlockPart * MAX_WEIGHT_PARTS)]


class BlockStackLayer(ctypes.Structure):  # decode_layer.c's BlockStackLayer
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("qkv", BlockWeight), ("o", BlockWeight), ("gate_up", BlockWeight),
                ("down", BlockWeight), ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qk_eps", ctypes.c_float)]


def native_weight(linear) -> BlockWeight:
    """The BlockWeight of a BlockLinear (its `parts`), built on first use and kept on
    it. Raises ValueError for more parts than the struct holds."""
    weight = getattr(linear, "native_weight", None)
    if weight is not None:
        return weight
    if len(linear.parts) > MAX_WEIGHT_PARTS:
        raise ValueError(f"a block weight of {len(linear.parts)} parts "
                         f"(at most {MAX_WEIGHT_PARTS})")
    weight = BlockWeight(len(linear.parts))
    for slot, part in zip(weight.parts, linear.parts):
        slot.kind, slot.columns = BLOCK_KINDS[part.kind], part.codes.shape[0]
        slot.q, slot.d = part.codes.data_ptr(), part.scales.data_ptr()
        slot.m = None if part.minima is None else part.minima.data_ptr()
    linear.native_weight = weight
    return weight


def _check(status: int, name: str) -> None:
    if status:
        raise RuntimeError(f"{name} failed ({status})")


def gated_mlp(kernels, x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) in one call; x [rows, K] fp32 contiguous; `gate_up`
    ([2I, K], gate rows first) and `down` ([N, I]) are BlockLinears without bias, of
    any kinds -> [rows, N]."""
    rows, in_features = x.shape
    y = torch.empty(rows, down.out_features, dtype=torch.float32)
    _check(kernels.library.blocks_gated_mlp(
        x.data_ptr(), rows, in_features, ctypes.addressof(native_weight(gate_up)),
        gate_up.out_features // 2, ctypes.addressof(native_weight(down)), down.out_features,
        y.data_ptr(), kernels.num_threads), "blocks_gated_mlp")
    return y


def attention_half(kernels, x: torch.Tensor, norm, qkv, o_proj, cos: torch.Tensor,
                   sin: torch.Tensor, slot_mapping: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                   heads: int, scale: float, head_norms: tuple = (None, None)) -> torch.Tensor:
    """x + o_proj(attention(rope(qkv(rms_norm(x))))) for a decode step of T requests,
    writing their new K/V into the flat caches [slots, KVH, D] first (decode_layer.c).
    x [T, hidden]; cos, sin [T, D]; the projections are BlockLinears (qkv with or
    without its fp32 bias, o without); slots, lengths as in paged_decode_attention;
    head_norms: Qwen3's RMSNorms (q_norm, k_norm) of every q and k head, or Nones.
    The caller guarantees fp32, CPU, contiguous tensors (models/fast_decode.py's
    FastDecodeLayer)."""
    tokens, hidden = x.shape
    kv_heads, dim = keys.shape[1], keys.shape[2]
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    q_norm, k_norm = head_norms
    _check(kernels.library.block_attention_half(
        x.data_ptr(), tokens, hidden, norm.weight.data_ptr(), norm.eps,
        ctypes.addressof(native_weight(qkv)), None if qkv.bias is None else qkv.bias.data_ptr(),
        None if q_norm is None else q_norm.weight.data_ptr(),
        None if k_norm is None else k_norm.weight.data_ptr(),
        0.0 if q_norm is None else q_norm.eps, cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), keys.data_ptr(), values.data_ptr(),
        int(keys.dtype == torch.bfloat16), slots.data_ptr(), lengths.data_ptr(),
        slots.shape[1], heads, kv_heads, dim, scale, ctypes.addressof(native_weight(o_proj)),
        y.data_ptr(), kernels.num_threads), "block_attention_half")
    return y


def mlp_half(kernels, x: torch.Tensor, norm, gate_up, down) -> torch.Tensor:
    """x + down(silu(gate(h)) * up(h)), h = rms_norm(x): the MLP half of a Llama
    layer in one call (decode_layer.c); same guarantees as attention_half."""
    tokens, hidden = x.shape
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    _check(kernels.library.block_mlp_half(
        x.data_ptr(), tokens, hidden, norm.weight.data_ptr(), norm.eps,
        ctypes.addressof(native_weight(gate_up)), gate_up.out_features // 2,
        ctypes.addressof(native_weight(down)), y.data_ptr(), kernels.num_threads),
        "block_mlp_half")
    return y

"""What a family's decoder layer is made of, declared once per family.

Every path that runs a layer (the modules, the fast decode layer and stack on GGUF
blocks, the packed layer, the packed stack) reads a family's traits from its
LayerSpec, never by probing the modules for attributes:

    family      qkv bias  q/k norms  sandwich norms  norm offset  activation
    Llama, Mistral  -        -            -             0         silu
    Qwen2           x        -            -             0         silu
    Qwen3           -        x            -             0         silu
    Gemma 3         -        x            x             1         gelu (tanh)

`native_traits` is the one function that turns a layer's traits into the native
struct every native layer path reads (kernels.h's LayerTraits, which both
decode_layer.c's BlockStackLayer and decoder_stack.c's StackLayer hold): a new trait
is a field here, its fill below, its field in LayerTraits (and its ctypes mirror in
kernels/block_layers.py), the kernels' use of it, and a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.block_layers import LayerTraits

FULL, SLIDING = 0, 1
"""Attention groups (the native structs' `group`): full-context layers, and sliding-
window layers, which read the step's `meta.sliding` (and Gemma 3's local rotary
tables)."""


@dataclass(frozen=True)
class LayerSpec:
    """A family's layer traits; one per model, shared by its layers."""

    qkv_bias: bool
    """A bias on the fused q/k/v projection (Qwen2; Llama's `attention_bias`)."""
    o_bias: bool
    """A bias on the output projection (Llama's `attention_bias`)."""
    mlp_bias: bool
    """Biases on the MLP's projections (Llama's `mlp_bias`)."""
    qk_norm: bool
    """An RMSNorm over every q and k head before RoPE (Qwen3, Gemma 3)."""
    sandwich_norms: bool
    """Norms on the attention's and the MLP's outputs too, and the MLP's input norm
    named pre_feedforward_layernorm (Gemma 3)."""
    norm_offset: float
    """1.0: norms multiply by (1 + weight) (Gemma); 0.0: by the weight."""
    activation: str
    """The gated MLP's activation, a transformers `hidden_act` name."""
    layer_is_sliding: tuple[bool, ...]
    """Per layer: whether it attends to the last `sliding_window` positions only."""
    sliding_window: int | None
    """None where no layer slides."""
    attention_scale: float | None = None
    """What q.k is multiplied by (Gemma 3: query_pre_attn_scalar ** -0.5); None:
    head_dim ** -0.5."""

    def __post_init__(self) -> None:
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"LayerSpec.norm_offset: 0.0 or 1.0, got {self.norm_offset}")
        if any(self.layer_is_sliding) and not self.sliding_window:
            raise ValueError("LayerSpec.sliding_window: sliding layers need a window")

    @property
    def num_layers(self) -> int:
        return len(self.layer_is_sliding)


def layer_norms(layer: nn.Module, spec: LayerSpec) -> tuple:
    """(before the attention, before the MLP, on the attention's output, on the MLP's
    output, per q head, per k head) of one of our decoder layers; None where the
    family has no such norm."""
    attn = layer.self_attn
    heads = (attn.q_norm, attn.k_norm) if spec.qk_norm else (None, None)
    if spec.sandwich_norms:
        return (layer.input_layernorm, layer.pre_feedforward_layernorm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm) + heads
    return (layer.input_layernorm, layer.post_attention_layernorm, None, None) + heads


def norm_weight(norm: nn.Module | None) -> torch.Tensor | None:
    """The fp32 weight rms_norm multiplies by: Gemma's 1 + weight, else the weight."""
    if norm is None:
        return None
    weight = norm.weight.detach()
    return (weight + norm.offset).contiguous() if norm.offset else weight.contiguous()


def norms_fit_native(layer: nn.Module, spec: LayerSpec) -> bool:
    """Whether the native layer structs can hold the layer's norms: fp32 CPU weights,
    q and k norms of one eps, the two output norms of one eps (each struct holds one
    eps per pair)."""
    first, second, attn_out, mlp_out, q_norm, k_norm = layer_norms(layer, spec)
    return (all(norm is None or (norm.weight.dtype == torch.float32
                                 and norm.weight.device.type == "cpu")
                for norm in (first, second, attn_out, mlp_out, q_norm, k_norm))
            and (attn_out is None or attn_out.eps == mlp_out.eps)
            and (q_norm is None or q_norm.eps == k_norm.eps))


@dataclass(frozen=True)
class NativeTraits:
    """A layer's LayerTraits struct and the tensors it points at, which must be kept
    alive as long as the struct."""

    struct: LayerTraits
    kept: tuple[torch.Tensor, ...]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def native_traits(layer: nn.Module, spec: LayerSpec, layer_idx: int) -> NativeTraits:
    """The LayerTraits of layer `layer_idx` (the caller checked norms_fit_native). The
    qkv bias is the projection's own fp32 tensor."""
    norms = layer_norms(layer, spec)
    first, second, attn_out, _, q_norm, _ = norms
    scaled = [norm_weight(norm) for norm in norms]
    bias = layer.self_attn.qkv_proj.bias.detach().contiguous() if spec.qkv_bias else None
    struct = LayerTraits(
        input_norm=_pointer(scaled[0]), post_norm=_pointer(scaled[1]),
        input_eps=first.eps, post_eps=second.eps,
        attn_out_norm=_pointer(scaled[2]), mlp_out_norm=_pointer(scaled[3]),
        out_eps=0.0 if attn_out is None else attn_out.eps,
        q_norm=_pointer(scaled[4]), k_norm=_pointer(scaled[5]),
        qk_eps=0.0 if q_norm is None else q_norm.eps,
        qkv_bias=_pointer(bias),
        group=SLIDING if spec.layer_is_sliding[layer_idx] else FULL)
    return NativeTraits(struct, tuple(t for t in scaled + [bias] if t is not None))

"""One decoder layer of a CPU step as a few direct calls on its packed weights.

Steps the fast decode path does not take (prefill rows, decode steps past the block
kernels' rows, any step of a model without GGUF blocks) run the layer's modules: a
dozen module calls, the wrappers' checks and ~17 torch ops per layer. That Python is
a visible share of a bf16-weights decode step of the default model. For Llama-style
layers whose attention projections hold packed oneDNN weights of one dtype (fp32, or
bf16 in bf16-weights), this path calls the pieces directly:

    h = rms_norm(x), written in the weights' dtype (the modules cast it after)
    qkv = h @ Wqkv in fp32 (+ Qwen2's fp32 bias); rotate q and k, store k and v
        (rope_store)
    a = the backend's attention over the cache (already written)
    x = x + a @ Wo
    x = x + mlp(x): for GGUF layers and SiLU MLPs in gate/up pairs (paired_mlp.py)
        gate_up with its activation (packed_gated) and down straight on the packed
        weights (norm in the weights' dtype again); otherwise the MLP modules

with the modules' arithmetic in the same order: the output is bit-identical
(tests/engine/test_packed_layer.py). The step-wide checks (rotary tables, slots,
cache) are made once per step; a step they refuse, or one for the block kernels,
returns None and the modules run.
"""

from __future__ import annotations

import torch
from torch import nn

from .block_weights import BlockLinear, FusedBlockMLP
from .executors import LayerStep
from .linear_base import LinearMethod, packed_weight
from .packed_linear import PackedWeight, packed_gated, packed_linear
from .paired_mlp import PairedMLP

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_of(module: nn.Module) -> PackedWeight | None:
    """The projection's packed weight, where it has one and no bias."""
    return packed_weight(module)


def packed_with_bias(module: nn.Module) -> tuple[PackedWeight | None, torch.Tensor | None]:
    """(packed weight, its fp32 bias or None), or (None, None) where the projection has
    no packed weight or a bias of another dtype (Qwen2's qkv carries a bias)."""
    if not isinstance(module, LinearMethod) or module.packed is None:
        return None, None
    bias = module.bias
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return None, None
    return module.packed, None if bias is None else bias.detach().contiguous()


class PackedLayer:
    """A layer executor (executors.py) for CPU steps past the block kernels' rows."""

    def __init__(self, layer: nn.Module, kernels) -> None:
        attn = layer.self_attn
        self.attn, self.layer, self.kernels = attn, layer, kernels
        (self.qkv, self.qkv_bias), self.o = packed_with_bias(attn.qkv_proj), packed_of(attn.o_proj)
        self.dtype = self.qkv.dtype
        self.first, self.second = layer.input_layernorm, layer.post_attention_layernorm
        fused = layer.mlp.fused
        silu = isinstance(fused, (PairedMLP, FusedBlockMLP)) and fused.activation == "silu"
        self.gate_up = packed_of(layer.mlp.gate_up_proj) if silu else None
        self.down = packed_of(layer.mlp.down_proj) if self.gate_up is not None else None
        self.block_rows = attn.qkv_proj.max_rows if isinstance(attn.qkv_proj, BlockLinear) else 0
        """Steps of at most this many rows are the block kernels' (fast decode or modules)."""

    @staticmethod
    def applies(layer: nn.Module) -> bool:
        """A Llama-style layer (plain RMSNorms, no q/k norm, full attention) whose qkv
        (with or without an fp32 bias, as Qwen2's) and o (without) projections are
        packed in one dtype."""
        spec, attn = layer.spec, layer.self_attn
        if spec.qk_norm or spec.sandwich_norms or spec.norm_offset or attn.is_sliding:
            return False
        (qkv, _), o = packed_with_bias(attn.qkv_proj), packed_of(attn.o_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return (qkv is not None and o is not None and qkv.dtype == o.dtype
                and qkv.dtype in PACKED_DTYPES
                and all(n.weight.dtype == torch.float32 for n in norms))

    def fits(self, step: LayerStep) -> bool:
        """Rows past the block kernels', fp32 CPU hidden states, and a step and cache
        the native RoPE and attention take (step_fits)."""
        hidden, layer_idx = step.hidden, self.attn.layer_idx
        return (hidden.shape[0] > self.block_rows and hidden.dim() == 2
                and hidden.dtype == torch.float32 and hidden.is_contiguous()
                and hidden.device.type == "cpu"
                and step_fits(step.meta, step.cos, step.sin, step.kv_cache.key_caches[layer_idx],
                              step.kv_cache.value_caches[layer_idx]))

    def run(self, step: LayerStep) -> torch.Tensor:
        """The layer's output [T, hidden]."""
        attn, kernels, fp32 = self.attn, self.kernels, torch.float32
        key_cache = step.kv_cache.key_caches[attn.layer_idx]
        value_cache = step.kv_cache.value_caches[attn.layer_idx]
        hidden = step.hidden
        qkv = packed_linear(kernels.rms_norm(hidden, self.first.weight, self.first.eps,
                                             self.dtype), self.qkv, fp32)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        out = attn.attend_native(qkv, step.cos, step.sin, key_cache, value_cache, step.meta,
                                 step.backend, kernels)
        hidden = hidden + packed_linear(out.to(self.dtype), self.o, fp32)
        if self.gate_up is None:
            return hidden + self.layer.mlp(self.second(hidden))
        normed = kernels.rms_norm(hidden, self.second.weight, self.second.eps, self.dtype)
        activated = packed_gated(normed, self.gate_up, kernels)
        return hidden + packed_linear(activated, self.down, fp32)


def step_fits(meta, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor) -> bool:
    """The rotary tables cover whole heads as contiguous CPU fp32, the slots are
    contiguous int64, and the caches are contiguous fp32 or bf16 of one dtype."""
    head_dim = key_cache.shape[-1]
    return (cos.shape == sin.shape == (cos.shape[0], head_dim)
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                    for t in (cos, sin))
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
            and key_cache.dtype == value_cache.dtype and key_cache.dtype in PACKED_DTYPES
            and key_cache.is_contiguous() and value_cache.is_contiguous())

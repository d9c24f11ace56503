"""Building blocks shared by our decoder models: RMSNorm, rotary embeddings, the
gated MLP. Written to match transformers' numerics in fp32 (same op order)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from ..kernels import default_kernels


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32. `offset=1.0` gives Gemma's (1 + weight)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0,
                 weight: torch.Tensor | None = None) -> None:
        """`weight` [dim]: the checkpoint's (ModelParts.tensor), else ones."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if weight is None else weight,
                                   requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.offset and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.device.type == "cpu"):
            kernels = default_kernels()
            if kernels is not None and x.dim() == 2 and x.is_contiguous():
                # one native pass (kernels/layer_ops.c); torch's composite norm is ~6
                # ops, each a pass over memory. The same arithmetic, summed in another
                # order.
                return kernels.rms_norm(x, self.weight, self.eps)
            # one op; on CPU bit-identical to the steps below (CUDA's kernel reduces
            # in another order)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        if input_dtype != torch.float32 and not self.offset:
            # half precision: torch's norm computes in fp32 and rounds its result to
            # the input's dtype once, transformers' arithmetic in one op (CUDA's fused
            # kernel): a decode step's graph holds 2 kernels per norm, not 8
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        x = x.float()
        if input_dtype == torch.float32:
            # transformers' ops, in its order: the exact fp32 path on accelerators
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            # (1 + weight) multiplies the fp32 norm before the rounding: one fused op
            # for the norm itself
            x = F.rms_norm(x, self.weight.shape, None, self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(input_dtype)
        return self.weight * x.to(input_dtype)


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused in one matmul: `gate_up_proj`
    [hidden -> 2 I] and `down_proj` [I -> hidden] in their linear methods."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: str,
                 fused=None) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}")
        self.intermediate_size = gate_up_proj.out_features // 2
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.act = ACTIVATIONS[act]
        self.act_name = act
        self.fused = fused
        """Optional callable x -> output or None (not for this step), chosen at load
        when the projections can run as one native call (method_choice.mlp_path:
        block_weights.FusedBlockMLP, paired_mlp.PairedMLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and not torch.compiler.is_compiling():  # native kernel
            out = self.fused(x)
            if out is not None:
                return out
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def rope_parameters(config: Any) -> dict:
    """The rope settings of a transformers config, whichever version wrote it:
    newer configs keep them in `rope_parameters`, older ones in `rope_theta` plus
    `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(head_dim: int, params: dict, config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] fp32, computed on the CPU, and the attention
    scaling factor."""
    base = float(params["rope_theta"])
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    dim = int(head_dim * partial)
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (base ** (steps / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a
    smooth blend in between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for the positions of one step, computed once and shared by all layers."""

    def __init__(self, head_dim: int, params: dict, config: Any,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(head_dim, params, config)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, rot_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)                             # [T, rot_dim]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, rot_dim] (rotate-half convention)."""
    rot_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rot_dim == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)

"""Which linear method (linear_base.py) each projection and the LM head of one of our
models takes, chosen as the model is built (model_parts.py asks for each one), and
the one table the load log shows of it.

The choice follows the checkpoint and the dtype, in this order:

    1. a GGUF checkpoint with the block kernels: the projections and head whose
       blocks it holds are BlockLinear (no dense copy where the blocks serve every
       step size)
    2. dtype bf16-weights / int8-weights: Bf16WeightLinear or Int8WeightLinear, and
       their LM heads (mixed_precision.py); BlockLinear keeps a bf16 dense copy
       where the native bf16 GEMM serves
    3. single-process CPU: every dense weight is packed for oneDNN (PackedLinear), and
       gated MLPs on bf16 pairs get their fused path (paired_mlp.py)

The table, logged once the model is built:

    projection  method                                      layers
    qkv         GGUF blocks Q4_K+Q6_K, no dense copy        24
    ...
    lm_head     GGUF blocks Q6_K, no dense copy
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .block_weights import BlockLinear, FusedBlockMLP
from .linear_base import LinearMethod
from .mixed_precision import Bf16RescoredHead, Bf16WeightLinear, Int8WeightLinear
from .packed_linear import PackedLinear, gate_pairs
from .paired_mlp import PairedMLP
from ..kernels.native import FUSED_ACTIVATIONS


@dataclass(frozen=True)
class LinearPlan:
    """The load plan's choices for the linear methods (load_plan.py)."""
    weights: str | None = None
    """load_plan.DtypeMode.weights: "bf16", "int8" or None (the activations' dtype)."""
    pack: bool = False
    """Pack dense weights for oneDNN (single-process CPU)."""
    native_bf16: bool = False
    """The native bf16 GEMM serves (bf16 dense copies of GGUF blocks pay)."""
    block_kernels: Any = None
    """The native kernels that serve a GGUF's blocks, or None (dense weights)."""
    dense_table: bool = False
    """Keep the fp32 embedding table and head beside their blocks (bf16-weights redoes
    its head's best logits from it)."""
    executor_kernels: Any = None
    """The native kernels the layer executors run on (executor_choice.py), or None."""


class DenseLinear(nn.Linear):
    """nn.Linear on the checkpoint's tensors (no random init, no copy)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                 plan: LinearPlan) -> nn.Module:
    """A projection on a dense weight [out, in] in the plan's method."""
    if plan.weights == "bf16":
        return Bf16WeightLinear(weight, bias, plan.pack)
    if plan.weights == "int8":
        return Int8WeightLinear(weight, bias)
    packed = PackedLinear.from_weight(weight, bias) if plan.pack else None
    return packed or DenseLinear(weight, bias)


def block_linear(weight: torch.Tensor | None, bias: torch.Tensor | None, blocks: list,
                 plan: LinearPlan) -> BlockLinear:
    """A projection on a GGUF's blocks (`weight`: its dense copy for large steps, or
    None where the blocks serve every step)."""
    return BlockLinear(weight, bias, blocks, plan.block_kernels,
                       bf16_dense=plan.weights == "bf16" and plan.native_bf16, pack=plan.pack)


def head_method(blocks: BlockLinear | None, weight: torch.Tensor | None, tied: bool,
                plan: LinearPlan) -> nn.Module | None:
    """The LM head in the plan's method: on a GGUF's `blocks` where it has them, and
    on `weight` [vocab, hidden] fp32 (the head's, or the embedding table's when
    `tied`; None where only blocks hold it). None: the logits multiply the table."""
    if plan.weights == "bf16" and (blocks is None or plan.native_bf16):
        return Bf16RescoredHead(weight, blocks, plan.pack)
    if plan.weights == "int8":
        return Int8WeightLinear(weight, None)
    if blocks is not None:
        return blocks
    packed = PackedLinear.from_weight(weight, None) if plan.pack else None
    return packed or (None if tied else DenseLinear(weight, None))


def mlp_path(gate_up: nn.Module, down: nn.Module, activation: str, plan: LinearPlan):
    """A gated MLP's native path (layers.GatedMLP.fused), or None: one block-kernel call
    where both projections are blocks, else the bf16 pairs' fused GEMM."""
    if FusedBlockMLP.applies(gate_up, down, activation):
        if gate_up.packed is not None:          # gate/up pairs for packed_gated
            gate_pairs(gate_up.packed)
        return FusedBlockMLP(gate_up, down, plan.block_kernels, FUSED_ACTIVATIONS[activation])
    return PairedMLP.build(gate_up, down, activation) if plan.pack else None


PROJECTIONS = {"qkv": lambda layer: layer.self_attn.qkv_proj,
               "o": lambda layer: layer.self_attn.o_proj,
               "gate_up": lambda layer: layer.mlp.gate_up_proj,
               "down": lambda layer: layer.mlp.down_proj}
"""A decoder layer's projections by kind."""


def describe(module: nn.Module | None) -> str:
    """A projection's method as the table names it."""
    if isinstance(module, LinearMethod):
        return module.describe()
    if module is None:
        return "the embedding table, dense"
    dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    kind = "dense" if isinstance(module, nn.Linear) else type(module).__name__   # TP shards
    return f"{kind} {dtype}"


def method_table(model: nn.Module) -> list[tuple[str, str, int]]:
    """(projection kind, method, how many layers) rows, the LM head last (count 1)."""
    rows: list[tuple[str, str, int]] = []
    for kind, projection in PROJECTIONS.items():
        counts = Counter(describe(projection(layer)) for layer in model.layers)
        rows += [(kind, method, count) for method, count in counts.items()]
    rows.append(("lm_head", describe(model.lm_head), 1))
    return rows


def format_method_table(rows: list[tuple[str, str, int]]) -> str:
    width = max(len(method) for _, method, _ in rows)
    return "\n".join(f"  {kind:<8} {method:<{width}}  x{count}" for kind, method, count in rows)

"""LinearMethod: the base of every projection form besides a plain nn.Linear.

A projection (q/k/v, o, gate/up, down) and the LM head each hold one module that owns
its weight's stored form and how it multiplies; the layer's forward calls it and
never asks which form it is. The forms:

    DenseLinear        dense float32 / bf16 / fp16, F.linear           method_choice.py
    PackedLinear       dense, packed once for oneDNN and the bf16 GEMM  packed_linear.py
    BlockLinear        a GGUF file's blocks (+ a packed dense copy only  block_weights.py
                       where the blocks do not serve every step size)
    Bf16WeightLinear   bf16 weights, fp32 activations                   mixed_precision.py
    Int8WeightLinear   int8 weights with per-channel scales             mixed_precision.py
    Bf16RescoredHead   LM head: bf16 logits, the top ones redone fp32   mixed_precision.py

Which form each projection takes is chosen as the model is built (method_choice.py,
asked by model_parts.py for each one), and the load logs one table of them.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearMethod(nn.Module):
    """y = x @ W^T (+ bias) for x [..., in_features], with W held in this method's form."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias: torch.Tensor | None = None
        self.packed = None
        """The dense weight packed for oneDNN at construction: a
        packed_linear.PackedWeight, where this form has one."""

    def describe(self) -> str:
        """The form's name in the load log's table."""
        raise NotImplementedError


def packed_weight(module: nn.Module):
    """A projection's packed weight (packed_linear.PackedWeight), where it is a
    LinearMethod with one and no bias; else None."""
    if isinstance(module, LinearMethod) and module.bias is None:
        return module.packed
    return None

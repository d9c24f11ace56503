"""Mixed precision for CPU serving: bf16 weights in the decoder layers' matmuls, fp32
everywhere else (embeddings, the residual stream, norms, attention, the LM head).

Each projection casts its fp32 input to bf16, multiplies against bf16 weights (bf16
matmuls run ~2.5x faster than fp32 on AVX-512 BF16 CPUs and read half the bytes) and
returns fp32. Keeping the residual stream and the LM head in fp32 keeps most of the
accuracy that full bf16 loses (measured with `python -m bench.accuracy`, see
docs/benchmarks.md). Selected with `load_model(..., dtype="bf16-weights")`.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

MIXED_DTYPE_NAMES = ("bf16-weights", "bfloat16-weights")


class Bf16WeightLinear(nn.Module):
    """A linear layer with bf16 weights and fp32 (or any) activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


def use_bf16_weights(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear inside the decoder layers for a Bf16WeightLinear, in place.
    The embedding table (and a tied LM head) stays fp32."""
    for layer in model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Bf16WeightLinear(child))
    return model

"""Gated MLPs on bf16 weights packed in pairs: the gate/up product writes the
activation itself.

A GatedMLP of a bf16-weights model (Bf16WeightLinear projections, packed for the
native GEMM) otherwise runs gate/up to fp32, then torch's activation and product
(three ops and a pass over [T, 2I] each), then down. Here its gate/up weight is
reordered into gate/up pairs once at load (packed_linear.gate_pairs: plain products
still come out gate columns first, so every other reader is unchanged) and steps of
up to NATIVE_BF16_MAX_ROWS rows run

    g = act(h @ Wgate) * (h @ Wup)     one bf16_gated_gemm, from its fp32 sums, bf16 out
    y = g @ Wdown                      fp32

the module path's arithmetic in the same order (its activation and product were in
fp32 before down's bf16 cast too); only the activation's own rounding differs, by
an ulp or so. SiLU and Gemma's GELU-tanh are fused; other activations keep the
modules. The pairs are also what the whole-stack path reads (packed_stack.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.native import FUSED_ACTIVATIONS
from .block_weights import BlockLinear
from .linear_base import packed_weight
from .packed_linear import PackedWeight, gate_pairs, packed_gated, packed_linear



def _bf16_paired(module: nn.Module) -> PackedWeight | None:
    packed = packed_weight(module)
    usable = packed is not None and packed.pairs is not None and packed.dtype == torch.bfloat16
    return packed if usable else None


class PairedMLP:
    """GatedMLP.fused for an MLP whose gate/up and down hold bf16 pairs."""

    def __init__(self, gate_up: PackedWeight, down: PackedWeight, activation: str,
                 block_rows: int = 0) -> None:
        self.gate_up, self.down, self.activation = gate_up, down, activation
        self.block_rows = block_rows
        """Steps of at most this many rows stay on the projections' exact GGUF block
        kernels (BlockLinear.max_rows; 0 without blocks)."""

    @staticmethod
    def build(gate_up_proj: nn.Module, down_proj: nn.Module,
              act_name: str) -> "PairedMLP | None":
        """Pair the gate/up projection's packed weight (as the MLP is built) and return
        the MLP's fused call, or None (and nothing changed) where it does not qualify."""
        activation = FUSED_ACTIVATIONS.get(act_name)
        gate_up, down = _bf16_paired(gate_up_proj), _bf16_paired(down_proj)
        if activation is None or gate_up is None or down is None:
            return None
        gate_pairs(gate_up)
        block_rows = max(m.max_rows if isinstance(m, BlockLinear) else 0
                         for m in (gate_up_proj, down_proj))
        return PairedMLP(gate_up, down, activation, block_rows) if gate_up.gated_inter else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP's output [T, hidden] fp32, or None when the step is for the modules
        (an input it does not take; a step for the block kernels; GELU past the native
        GEMM's rows, where SiLU runs as FusedBlockMLP's larger steps do)."""
        if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.shape[0] <= self.block_rows):
            return None
        activated = packed_gated(x.to(torch.bfloat16), self.gate_up, None, self.activation)
        if activated is None:
            return None
        return packed_linear(activated, self.down, torch.float32)

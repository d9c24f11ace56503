"""What a decode step must at least cost on this machine, to show measured steps as a
fraction of it: the bytes of weights one step of `rows` rows reads (each projection
and the LM head in the form that step uses: GGUF blocks for steps small enough for
the block kernels, else the dense or packed weight), and the matmul FLOPs per row.

Worked example, SmolLM2-135M in float32 with its GGUF blocks: a 1-row step reads the
Q4_1 projections (6 bits per weight as held: 4-bit codes, fp32 scale and minimum per
32) and the Q8_0 LM head (9 bits), 111.5 MB, which at 30 GB/s take 3.7 ms: an 8.3 ms
step runs at ~45% of that bound. Every row costs 269 MFLOP of matmuls (2 per
weight), so 64 rows in 73 ms run ~235 GFLOP/s.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.block_weights import BlockLinear
from engine.models.mixed_precision import Bf16RescoredHead, Bf16WeightLinear, Int8WeightLinear
from engine.models.packed_linear import PackedLinear
from engine.models.packed_stack import PackedStack

def _shape(module: nn.Module) -> tuple[int, int] | None:
    """(out_features, in_features) of a projection-like module, else None."""
    if isinstance(module, BlockLinear):
        return module.out_features, module.in_features
    if isinstance(module, (PackedLinear, Bf16WeightLinear)):
        return module.out_features, module.in_features
    if isinstance(module, Int8WeightLinear):
        return tuple(module.weight_int8.shape)
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    return None


def _bytes_read(module: nn.Module, rows: int, on_stack: bool = False) -> int:
    """Weight bytes a step of `rows` rows reads from this projection (`on_stack`: the
    step runs on a PackedStack, which reads the dense bf16 weights)."""
    out_features, in_features = _shape(module)
    if isinstance(module, BlockLinear):
        if rows <= module.max_rows and not on_stack:
            return sum(t.numel() * t.element_size() for part in module.parts
                       for t in (part.codes, part.scales, part.minima) if t is not None)
        dense = module.packed if module.packed is not None else module.weight
        return out_features * in_features * dense.dtype.itemsize
    if isinstance(module, Int8WeightLinear):
        return out_features * in_features + 2 * out_features
    if isinstance(module, Bf16WeightLinear):
        return out_features * in_features * 2
    if isinstance(module, PackedLinear):
        return out_features * in_features * module.packed.dtype.itemsize
    return module.weight.numel() * module.weight.element_size()


def _head(model: nn.Module) -> tuple[nn.Module | None, torch.Tensor | None]:
    """The LM head's linear method (None: a plain matmul on `weight`, the embedding
    table's or an nn.Linear's) and that dense weight (None with a method)."""
    head = model.lm_head
    if head is None or isinstance(head, nn.Linear):
        return None, (model.embed_tokens if head is None else head).weight
    return head, None


def weight_bytes_per_step(model: nn.Module, rows: int) -> int:
    """Bytes of projection and LM head weights one decode step of `rows` rows reads."""
    on_stack = any(isinstance(stack, PackedStack) and stack.block_rows < rows
                   for stack in model.executors.stacks)
    total = sum(_bytes_read(m, rows, on_stack) for m in model.layers.modules()
                if _shape(m) is not None)
    head, weight = _head(model)
    if isinstance(head, Bf16RescoredHead):
        exact = head.exact_head
        if rows <= head.exact_rows:
            return total + _bytes_read(exact, rows)
        return total + head.weight.numel() * 2
    if head is not None:
        return total + _bytes_read(head, rows)
    return total + weight.numel() * weight.element_size()


def matmul_flops_per_row(model: nn.Module) -> int:
    """2 FLOPs per weight of every projection and the LM head, per row."""
    weights = sum(out * inp for m in model.layers.modules()
                  if (shape := _shape(m)) is not None for out, inp in [shape])
    head, weight = _head(model)
    vocab, hidden = (head.out_features, head.in_features) if head is not None else weight.shape
    return 2 * (weights + vocab * hidden)

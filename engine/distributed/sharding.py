"""A decoder split across tensor-parallel ranks, Megatron style: each rank reads its
share as it builds its model (models/model_parts.py, Shard).

Per decoder layer, rank r of N keeps:
- attention: query heads [r*H/N, (r+1)*H/N) and KV heads [r*KVH/N, (r+1)*KVH/N)
  (the fused qkv_proj rows of those heads, "column parallel"), and the matching
  input columns of o_proj ("row parallel"); its KV cache holds only its KV heads;
- MLP: intermediate columns [r*I/N, (r+1)*I/N) of gate and of up, and the matching
  input columns of down_proj.
The two row-parallel projections produce partial sums that an all-reduce adds up,
then their bias (if any) is added once. Embeddings, norms and the LM head stay whole
on every rank, so every rank ends a step with the same hidden states.

Worked example, fused qkv_proj of H=4 query heads, KVH=2 KV heads, head_dim 8 and
N=2: the full weight has rows q[0:32] k[32:48] v[48:64]; rank 1 keeps
q[16:32] + k[40:48] + v[56:64] = 32 rows, i.e. heads 2-3 and KV head 1.
"""

from __future__ import annotations

import torch
from torch import nn

from .group import TensorParallelError, TensorParallelGroup


class RowParallelLinear(nn.Module):
    """`inner` holds this rank's input columns (no bias), in the plan's linear method:
    out = sum_r inner_r(x_r) + b."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.inner(x).contiguous())
        return out if self.bias is None else out + self.bias.to(out.dtype)


def check_shardable(config, tp_size: int) -> None:
    """Raise TensorParallelError unless `tp_size` divides every sharded dimension."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    checks = [("num_key_value_heads", num_kv_heads), ("num_attention_heads", num_heads),
              ("intermediate_size", config.intermediate_size)]
    for field, value in checks:
        if value % tp_size:
            raise TensorParallelError(
                f"tp_size={tp_size} must divide the model's {field} ({value}); "
                f"choose another --nproc-per-node")

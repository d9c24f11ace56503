"""Split a loaded decoder across tensor-parallel ranks, Megatron style.

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
    """`inner` holds this rank's input columns (no bias): out = sum_r inner_r(x_r) + b.
    `inner` stays an ordinary module so the low-precision modes can swap it."""

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


def shard_model(model: nn.Module, group: TensorParallelGroup) -> nn.Module:
    """Keep rank `group.rank`'s part of every layer of `model`, in place."""
    for layer in model.layers:
        _shard_attention(layer.self_attn, group)
        _shard_mlp(layer.mlp, group)
    return model


def _rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return tensor.narrow(0, start, size)


def _shard_attention(attn: nn.Module, group: TensorParallelGroup) -> None:
    rank, world = group.rank, group.world_size
    q_size, kv_size = attn.q_size // world, attn.kv_size // world
    qkv = attn.qkv_proj

    def pick(tensor: torch.Tensor) -> torch.Tensor:
        q, k, v = tensor.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
        return torch.cat([_rows(q, rank * q_size, q_size), _rows(k, rank * kv_size, kv_size),
                          _rows(v, rank * kv_size, kv_size)]).clone()

    attn.qkv_proj = _linear(pick(qkv.weight.data),
                            None if qkv.bias is None else pick(qkv.bias.data))
    attn.o_proj = _row_parallel(attn.o_proj, rank * q_size, q_size, group)
    attn.num_heads //= world
    attn.num_kv_heads //= world
    attn.q_size, attn.kv_size = q_size, kv_size


def _shard_mlp(mlp: nn.Module, group: TensorParallelGroup) -> None:
    rank, world = group.rank, group.world_size
    size = mlp.intermediate_size // world
    gate_up = mlp.gate_up_proj

    def pick(tensor: torch.Tensor) -> torch.Tensor:
        gate, up = tensor.split(mlp.intermediate_size, dim=0)
        return torch.cat([_rows(gate, rank * size, size), _rows(up, rank * size, size)]).clone()

    mlp.gate_up_proj = _linear(pick(gate_up.weight.data),
                               None if gate_up.bias is None else pick(gate_up.bias.data))
    mlp.down_proj = _row_parallel(mlp.down_proj, rank * size, size, group)
    mlp.intermediate_size = size


def _row_parallel(linear: nn.Linear, start: int, size: int,
                  group: TensorParallelGroup) -> RowParallelLinear:
    weight = linear.weight.data.narrow(1, start, size).clone()
    bias = None if linear.bias is None else linear.bias.data.clone()
    return RowParallelLinear(_linear(weight, None), bias, group)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear wrapping the given tensors without a fresh random init."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


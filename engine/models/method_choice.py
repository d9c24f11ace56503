"""Which linear method (linear_base.py) each projection and the LM head of one of our
models takes, chosen at load, and the one table the load log shows of it.

The choice follows the checkpoint and the dtype, in this order:

    1. a GGUF checkpoint with the block kernels: its projections and head become
       BlockLinear before any weight is loaded (block_install.use_blocks, run from
       build_model's `prepare`, so weights the blocks serve are never made dense)
    2. dtype bf16-weights / int8-weights: Bf16WeightLinear or Int8WeightLinear, and
       their LM heads (mixed_precision.py)
    3. single-process CPU: every dense weight is packed for oneDNN (PackedLinear), and
       gated MLPs on bf16 pairs get their fused path (paired_mlp.py)

`choose_linear_methods` runs steps 2 and 3 on the loaded model and logs the table:

    projection  method                                      layers
    qkv         GGUF blocks Q4_K+Q6_K, no dense copy        24
    ...
    lm_head     GGUF blocks Q6_K, no dense copy
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from .block_weights import FusedBlockMLP
from .linear_base import LinearMethod
from .mixed_precision import use_bf16_weights, use_int8_weights
from .packed_linear import PackedLinear, gate_pairs, pack_weight
from .paired_mlp import use_paired_mlps

logger = logging.getLogger(__name__)

PROJECTIONS = {"qkv": lambda layer: layer.self_attn.qkv_proj,
               "o": lambda layer: layer.self_attn.o_proj,
               "gate_up": lambda layer: layer.mlp.gate_up_proj,
               "down": lambda layer: layer.mlp.down_proj}
"""A decoder layer's projections by kind."""


def choose_linear_methods(model: nn.Module, weights: str | None, pack: bool,
                          native_bf16: bool = False) -> None:
    """Give the loaded model the methods of its dtype's `weights` (load_plan.DtypeMode:
    "bf16", "int8" or None; `native_bf16`: the plan's, whether the native bf16 GEMM
    serves) and, with `pack` (single-process CPU), pack its dense weights; then log
    the table."""
    if weights == "bf16":
        use_bf16_weights(model, native_bf16)
    elif weights == "int8":
        use_int8_weights(model)
    if pack:
        pack_dense_weights(model)
    logger.info("linear methods:\n%s", format_method_table(method_table(model)))


def pack_dense_weights(model: nn.Module) -> int:
    """Pack every dense projection that can be, the LM head included; returns how many
    were packed."""
    count = sum(1 for module in list(model.modules())
                if isinstance(module, LinearMethod) and module.pack_dense())
    for layer in model.layers:              # gated MLPs: gate/up pairs for packed_gated
        fused = layer.mlp.fused
        if isinstance(fused, FusedBlockMLP) and fused.gate_up.packed is not None:
            gate_pairs(fused.gate_up.packed)
    use_paired_mlps(model)
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    packed = PackedLinear.from_linear(child)
                    if packed is not None:
                        setattr(parent, name, packed)
                        count += 1
    head = model.lm_head
    if head is None or type(head) is nn.Linear:
        weight = model.embed_tokens.weight if head is None else head.weight
        packed = pack_weight(weight)
        if packed is not None:
            model.use_lm_head(PackedLinear(packed, None, weight.shape[1], weight.shape[0]))
            count += 1
    return count


def describe(module: nn.Module | None) -> str:
    """A projection's method as the table names it."""
    if isinstance(module, LinearMethod):
        return module.describe()
    if module is None:
        return "the embedding table, dense"
    dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    kind = "dense" if type(module) is nn.Linear else type(module).__name__   # TP shards
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

"""What one of our models is built from: a checkpoint's tensors and the load plan's
choices, handed to the model's constructor, which asks for each part as it builds
it. A built model is final: nothing changes it afterwards.

    parts = ModelParts(CheckpointTensors.of_state(state, dtype, device), LinearPlan(...))
    model = LlamaFamilyForCausalLM(config, parts)

Names are the model's own (`layers.3.self_attn.qkv_proj.weight`); the checkpoint's
are transformers' (`model.layers.3.self_attn.q_proj.weight`, k, v), joined here in
row order. A GGUF checkpoint's projections, table and head whose blocks the kernels
read become BlockLinear / BlockEmbedding (method_choice.py picks every method).
Under tensor parallelism each rank reads its own rows of the column-parallel
projections (q, k, v and gate, up each split by rank) and its own columns of the
row-parallel ones (o, down), which all-reduce their products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .block_formats import Blocks
from .block_weights import BlockLinear, blocks_serve_every_step, joined
from .executors import Executors
from .method_choice import LinearPlan, block_linear, dense_linear, head_method

FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""Our fused projections -> the transformers projections they join, in row order."""
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
LAYER_PARTS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight",
               "mlp.down_proj.bias", "input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


def hf_weight_names(num_layers: int) -> list[str]:
    """Every weight name a transformers checkpoint of the families we have code for
    may hold, in transformers' naming (q, k, v and gate, up unfused)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        names += [f"{prefix}{part}.{kind}" for parts in FUSED_PARTS.values() for part in parts
                  for kind in ("weight", "bias")]
        names += [prefix + part for part in LAYER_PARTS]
    return names


def hf_parts(name: str) -> list[str]:
    """Our tensor name -> the transformers names it joins (without the `model.`
    prefix), in row order."""
    stem, _, kind = name.rpartition(".")
    for fused, parts in FUSED_PARTS.items():
        if stem.endswith("." + fused):
            return [f"{stem[:-len(fused)]}{part}.{kind}" for part in parts]
    return [name]


@dataclass(frozen=True)
class Shard:
    """This rank's share of the sharded projections."""
    rank: int
    world: int

    def of(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """One transformers part of tensor `name`, cut to this rank's rows (column-
        parallel) or input columns (a row-parallel weight); others whole."""
        stem, _, kind = name.rpartition(".")
        dim = 0 if stem.endswith(tuple(FUSED_PARTS)) else \
            1 if stem.endswith(ROW_PARALLEL) and kind == "weight" else None
        if dim is None:
            return part
        size = part.shape[dim] // self.world
        return part.narrow(dim, self.rank * size, size)


class CheckpointTensors:
    """A checkpoint's tensors by our names, each taken once from `lookup` (a
    transformers name -> the tensor, dropped from its source, or None), in `dtype`
    (floating ones) on `device`; `copy`: never share the source's storage."""

    def __init__(self, lookup: Callable[[str], torch.Tensor | None], dtype: torch.dtype,
                 device: torch.device, copy: bool = False, shard: Shard | None = None) -> None:
        self.lookup, self.dtype, self.device = lookup, dtype, device
        self.copy, self.shard = copy or shard is not None, shard

    @staticmethod
    def of_state(state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 copy: bool = False, shard: Shard | None = None) -> "CheckpointTensors":
        def take(name: str) -> torch.Tensor | None:
            tensor = state.pop("model." + name, None)
            return state.pop(name, None) if tensor is None else tensor
        return CheckpointTensors(take, dtype, device, copy, shard)

    def take(self, name: str) -> torch.Tensor | None:
        found = [self.lookup(part) for part in hf_parts(name)]
        if any(part is None for part in found):
            return None
        if self.shard is not None:
            found = [self.shard.of(name, part) for part in found]
        joined_parts = found[0] if len(found) == 1 else torch.cat(found)
        tensor = joined_parts.to(device=self.device, dtype=self.dtype
                                 if joined_parts.is_floating_point() else None).contiguous()
        if self.copy and len(found) == 1 and tensor.data_ptr() == found[0].data_ptr():
            tensor = tensor.clone()
        return tensor


@dataclass(frozen=True)
class ModelParts:
    """The constructor input of our models (llama.py, gemma3.py)."""
    tensors: CheckpointTensors
    plan: LinearPlan = LinearPlan()
    blocks: dict[str, Blocks] | None = None
    """A GGUF checkpoint's blocks by transformers name, which plan.block_kernels
    multiply; None without them."""
    kv_cache_dtype: torch.dtype | None = None
    tp_group: Any = None
    """TensorParallelGroup when the weights are sharded over torchrun ranks."""

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else self.tp_group.world_size

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint's tensor `name`, checked against `shape` (this rank's)."""
        tensor = self.tensors.take(name)
        if tensor is None:
            raise ValueError(f"weights missing from the checkpoint: {[name]}")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weight {name}: expected shape {tuple(shape)}, "
                             f"got {tuple(tensor.shape)}")
        return tensor

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """Projection `name` (`layers.0.self_attn.qkv_proj`) in the plan's method."""
        bias_value = self.tensor(f"{name}.bias", (out_features,)) if bias else None
        runs = self._blocks(name, out_features)
        if runs is not None:
            only = blocks_serve_every_step(runs, self.plan.block_kernels)
            weight = None if only else self.tensor(f"{name}.weight", (out_features, in_features))
            return block_linear(weight, bias_value, runs, self.plan)
        weight = self.tensor(f"{name}.weight", (out_features, in_features))
        if self.tp_group is not None and name.endswith(ROW_PARALLEL):
            from ..distributed.sharding import RowParallelLinear

            return RowParallelLinear(dense_linear(weight, None, self.plan), bias_value,
                                     self.tp_group)
        return dense_linear(weight, bias_value, self.plan)

    def _blocks(self, name: str, out_features: int) -> list[Blocks] | None:
        """The joined blocks of projection `name` where the GGUF holds every part as
        blocks (dropped from the checkpoint where they serve every step: the joined
        copy is then the only one), else None."""
        names = ["model." + part for part in hf_parts(f"{name}.weight")]
        found = [self._block(n) for n in names]
        if any(b is None for b in found):
            return None
        if sum(b.shape[0] for b in found) != out_features:
            raise ValueError(f"{name}: blocks of {[b.shape[0] for b in found]} rows for "
                             f"{out_features} outputs")
        runs = joined(found)
        if blocks_serve_every_step(runs, self.plan.block_kernels):
            for part in names:
                del self.blocks[part]
        return runs

    def _block(self, name: str) -> Blocks | None:
        """The GGUF's blocks of tensor `name` (transformers' name), or None."""
        return None if self.blocks is None else self.blocks.get(name)

    def _only_blocks(self, blocks: Blocks | None) -> bool:
        """Whether `blocks` (a table's or head's) serve every step with no dense copy."""
        return (blocks is not None and not self.plan.dense_table
                and blocks_serve_every_step([blocks], self.plan.block_kernels))

    def embedding(self, vocab: int, hidden: int) -> nn.Module:
        """The embedding table: as blocks where they serve every step (and the plan
        keeps no dense table), else dense."""
        table = self._block("model.embed_tokens.weight")
        if self._only_blocks(table):
            return BlockEmbedding(table)
        weight = self.tensor("embed_tokens.weight", (vocab, hidden))
        return nn.Embedding(vocab, hidden, _weight=weight, _freeze=True)

    def lm_head(self, embedding: nn.Module, hidden: int, vocab: int,
                tied: bool) -> nn.Module | None:
        """The LM head (None: the logits multiply the embedding table): on the head's
        blocks, or the table's for a tied head, where the GGUF has them."""
        if tied:
            blocks = self._block("model.embed_tokens.weight")
            weight = None if isinstance(embedding, BlockEmbedding) else embedding.weight
        else:
            blocks = self._block("lm_head.weight")
            weight = None if self._only_blocks(blocks) else \
                self.tensor("lm_head.weight", (vocab, hidden))
        head = None if blocks is None else block_linear(weight, None, [blocks], self.plan)
        return head_method(head, weight, tied, self.plan)

    def executors(self, model: nn.Module) -> Executors:
        """The layer executors `model` (its layers built) qualifies for, or none."""
        kernels = self.plan.executor_kernels
        if kernels is None:
            return Executors()
        from .executor_choice import choose_executors

        return choose_executors(model, kernels)


class BlockEmbedding(nn.Module):
    """An embedding table kept as blocks: each step dequantizes just the rows it looks
    up ([T] ids -> [T, hidden] fp32, the values the dense table would hold)."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        self.blocks = blocks
        self.num_embeddings, self.embedding_dim = blocks.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.dequantize_rows(input_ids.reshape(-1))
        return rows.view(*input_ids.shape, self.embedding_dim)

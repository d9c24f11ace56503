"""A GGUF checkpoint's blocks installed on a built model, before any weight is loaded:
BlockLinear projections and LM head (block_weights.py), the embedding table as
blocks, the fused MLP path; and, for dtype int8-activations, every block form the int8
kernels take repacked for them (int8_blocks.py).

Weights the blocks serve at every step size keep no dense copy; their entries leave
the checkpoint's dict as they are installed, so the joined copy of a fused projection
(q, k, v as one) is the only one held.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .block_formats import Blocks
from .block_weights import BlockLinear, FusedBlockMLP, blocks_serve_every_step, joined
from .int8_blocks import int8_convertible, to_int8_form
from ..kernels.native import FUSED_ACTIVATIONS

logger = logging.getLogger(__name__)

_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}
"""Our projections -> the transformers parameters they hold, in row order."""
FUSED_PARTS = {name: parts for name, parts in _PROJECTIONS.items() if len(parts) > 1}
"""The projections that join several transformers parameters."""


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


class _Installer:
    """One model's choices: which blocks keep a dense copy, which are repacked."""

    def __init__(self, kernels, dense_table: bool, int8_activations: bool) -> None:
        self.kernels, self.dense_table, self.int8 = kernels, dense_table, int8_activations

    def forms(self, parts: list[Blocks]) -> list[Blocks]:
        """The parts joined into runs of one form, repacked where int8 takes them all."""
        runs = joined(parts)
        if self.int8 and all(int8_convertible(run) for run in runs):
            return [to_int8_form(run) for run in runs]
        return runs

    def blocks_only(self, runs: list[Blocks], table: bool = False) -> bool:
        """Whether these runs (forms' output; `table`: the embedding table's or the LM
        head's) need no dense copy."""
        return not (table and self.dense_table) and blocks_serve_every_step(runs, self.kernels)


def use_blocks(model: nn.Module, blocks: dict[str, Blocks], kernels,
               dense_table: bool, int8_activations: bool = False) -> set[str]:
    """Give `model` (built, its weights not loaded yet) BlockLinear projections (and LM
    head) wherever `blocks` (a GGUF checkpoint's, under transformers' names:
    gguf_checkpoint.py) holds every part. A weight whose blocks serve every step keeps
    no dense copy, the embedding table included (BlockEmbedding), unless it is the table
    or head and `dense_table` (bf16-weights redoes its LM head's best logits from the
    fp32 table; its projections make their bf16 weights from the blocks, one at a time). With `int8_activations`
    every weight of 16-column groups is repacked for the int8 kernels (a tied table
    once, for both the lookups and the head). Returns the names of the weights that
    need no dense value; every other one is still to be loaded (a BlockLinear shares
    its projection's dense parameter)."""
    installer = _Installer(kernels, dense_table, int8_activations)
    if int8_activations and not kernels.int8_vnni:
        logger.warning("int8-activations: this CPU has no AVX512-VNNI, so the int8 kernels "
                       "run their portable loop, slower than float32's")
    served: set[str] = set()
    for i, layer in enumerate(model.layers):
        for name, parts in _PROJECTIONS.items():
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, attr)
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            found = [blocks.get(n) for n in names]
            if not isinstance(linear, nn.Linear) or any(b is None for b in found):
                continue
            if sum(b.shape[0] for b in found) != linear.out_features:
                raise ValueError(f"layer {i} {name}: blocks of {[b.shape[0] for b in found]} "
                                 f"rows for {linear.out_features} outputs")
            runs = installer.forms(found)
            only = installer.blocks_only(runs)
            setattr(parent, attr, BlockLinear(linear, None if only else linear.weight, runs,
                                              kernels))
            if only:       # joined parts are copies: let the checkpoint's go at once
                served.update(names)
                for part in names:
                    del blocks[part]
    for layer in model.layers:
        if FusedBlockMLP.applies(layer.mlp):
            layer.mlp.use_fused(FusedBlockMLP(layer.mlp.gate_up_proj, layer.mlp.down_proj,
                                              kernels, FUSED_ACTIVATIONS[layer.mlp.act_name]))
    _use_table_and_head(model, blocks, installer, served)
    return served


def _use_table_and_head(model: nn.Module, blocks: dict[str, Blocks], installer: _Installer,
                        served: set[str]) -> None:
    """The embedding table as blocks where they serve every step, and the LM head on
    blocks: a tied head on the table's (one copy for both)."""
    kernels = installer.kernels
    table = blocks.get("model.embed_tokens.weight")
    table_runs = None if table is None else installer.forms([table])
    if table_runs is not None and installer.blocks_only(table_runs, table=True):
        model.embed_tokens = BlockEmbedding(table_runs[0])
        served.add("model.embed_tokens.weight")
    if model.lm_head is None:                       # tied
        if table_runs is not None:
            dense = (None if isinstance(model.embed_tokens, BlockEmbedding)
                     else model.embed_tokens.weight)
            model.use_lm_head(BlockLinear(None, dense, table_runs, kernels))
        return
    head = blocks.get("lm_head.weight")
    if head is None:
        return
    runs = installer.forms([head])
    only = installer.blocks_only(runs, table=True)
    model.use_lm_head(BlockLinear(None, None if only else model.lm_head.weight, runs, kernels))
    if only:
        served.add("lm_head.weight")

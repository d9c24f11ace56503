"""A GGUF checkpoint's blocks installed on a built model, before any weight is loaded:
BlockLinear projections and LM head (block_weights.py), the embedding table as
blocks, the fused MLP path. Blocks arrive in the form their kernels read: for dtype
int8-activations the parser wrote them in the int8 forms (gguf_checkpoint.py's
BlockParsing, int8_blocks.py).

Weights the blocks serve at every step size keep no dense copy; their entries leave
the checkpoint's dict as they are installed, so the joined copy of a fused projection
(q, k, v as one) is the only one held.
"""

from __future__ import annotations

import torch
from torch import nn

from .block_formats import Blocks
from .block_weights import BlockLinear, FusedBlockMLP, blocks_serve_every_step, joined
from ..kernels.native import FUSED_ACTIVATIONS

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


def use_blocks(model: nn.Module, blocks: dict[str, Blocks], kernels,
               dense_table: bool) -> set[str]:
    """Give `model` (built, its weights not loaded yet) BlockLinear projections (and LM
    head) wherever `blocks` (a GGUF checkpoint's, under transformers' names:
    gguf_checkpoint.py) holds every part. A weight whose blocks serve every step keeps
    no dense copy, the embedding table included (BlockEmbedding), unless it is the table
    or head and `dense_table` (bf16-weights redoes its LM head's best logits from the
    fp32 table; its projections make their bf16 weights from the blocks, one at a
    time). A tied head multiplies the table's blocks (one copy for the lookups and
    the head). Returns the names of the weights that need no dense value; every other
    one is still to be loaded (a BlockLinear shares its projection's dense parameter)."""
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
            runs = joined(found)
            only = blocks_serve_every_step(runs, kernels)
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
    _use_table_and_head(model, blocks, kernels, dense_table, served)
    return served


def _use_table_and_head(model: nn.Module, blocks: dict[str, Blocks], kernels,
                        dense_table: bool, served: set[str]) -> None:
    """The embedding table as blocks where they serve every step (and `dense_table` is
    not asked for), and the LM head on blocks: a tied head on the table's."""
    table = blocks.get("model.embed_tokens.weight")
    table_runs = None if table is None else [table]
    if table_runs is not None and not dense_table \
            and blocks_serve_every_step(table_runs, kernels):
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
    runs = [head]
    only = not dense_table and blocks_serve_every_step(runs, kernels)
    model.use_lm_head(BlockLinear(None, None if only else model.lm_head.weight, runs, kernels))
    if only:
        served.add("lm_head.weight")

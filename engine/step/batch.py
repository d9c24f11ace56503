"""Turn a ScheduledBatch into the flat tensors of one forward pass.

Everything is computed once per step on the host in Python lists, then moved to the
device in a few tensor constructions; layers only index into these tensors. Each
attention group's metadata comes from the runner's builder (its backend's:
attention/metadata.py's MetadataBuilder), or, for a decode-only step the decode fast
path takes, from FastPathBuilder: FixedTableMetadata over fixed-width tables
(decode_tables.py). Models with sliding-window layers get a second one
(`meta.sliding`) built over the requests' sliding-group blocks, with the window
applied (AttentionGroups).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..attention.backend import AttentionBackend
from ..attention.metadata import (AttentionMetadata, BlocksOf, FixedTableMetadata,
                                  MetadataBuilder, block_table, common_fields)
from ..core.requests import RequestState
from ..core.scheduler import ScheduledBatch
from .decode_tables import DecodeTables


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    """[S + V] long: the last row of each request that samples, then every row of
    each verify entry (its last token and its drafts), in entry order."""
    sampling_entries: list[int]      # [S] index into batch.entries of each sampling request
    verify_entries: list[int] = ()
    """Index into batch.entries of each entry with drafts (speculative decoding)."""
    pooling_entries: list[tuple[int, int]] = ()
    """(index into batch.entries, first row) of each embedding request's chunk: its
    rows' hidden states are pooled (engine/pooling.py) instead of sampled."""


@dataclass(frozen=True)
class AttentionGroups:
    """The model's attention groups, fixed per runner: the full-attention layers'
    (unless every layer slides, as in Mistral) and, with a sliding window, the sliding
    layers', over `sliding_blocks` (their own pool's blocks; None: the full blocks)."""
    full_layers: bool = True
    sliding_window: int | None = None
    sliding_blocks: Callable[[RequestState], list[int | None]] | None = None


@dataclass(frozen=True)
class FastPathBuilder:
    """The decode fast path over another builder: decode-only steps whose requests
    fit `tables` get fixed-width tables (FixedTableMetadata), whatever the backend;
    the others go to `varlen`. `backend` adds its per-step gather (its attention in
    `attention_dtype`)."""
    varlen: MetadataBuilder
    tables: DecodeTables
    page_size: int
    backend: AttentionBackend
    attention_dtype: torch.dtype

    def build(self, batch: ScheduledBatch, window: int | None, blocks_of: BlocksOf,
              device: torch.device) -> AttentionMetadata:
        width = _fast_path_width(batch, blocks_of, self.tables, self.page_size)
        if width is None:
            return self.varlen.build(batch, window, blocks_of, device)
        fields = common_fields(batch, self.page_size, device, window, blocks_of)
        table = block_table(batch, blocks_of, width, device)
        gather = self.backend.decode_gather(fields["seq_lens_k"], table, self.page_size,
                                            window, self.attention_dtype)
        return FixedTableMetadata(**fields, block_table=table, gather=gather)


def build_step_inputs(batch: ScheduledBatch, device: torch.device, builder: MetadataBuilder,
                      groups: AttentionGroups = AttentionGroups()) -> StepInputs:
    """The step's flat inputs, each attention group's metadata by `builder`."""
    rows = _flat_rows(batch)
    meta = None
    if groups.full_layers or groups.sliding_window is None:
        meta = builder.build(batch, None, lambda r: r.block_ids, device)
    if groups.sliding_window is not None:
        sliding = builder.build(batch, groups.sliding_window,
                                groups.sliding_blocks or (lambda r: r.block_ids), device)
        meta = replace(meta or sliding, sliding=sliding)
    return StepInputs(
        input_ids=torch.tensor(rows.input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(rows.positions, dtype=torch.long, device=device),
        meta=meta,
        logits_rows=torch.tensor(rows.logits_rows + rows.verify_rows, dtype=torch.long,
                                 device=device),
        sampling_entries=rows.sampling_entries, verify_entries=rows.verify_entries,
        pooling_entries=rows.pooling_entries,
    )


@dataclass
class _FlatRows:
    """The step's tokens flattened, one row each, and which rows give logits: sampled
    rows (`logits_rows`, their entries in `sampling_entries`), every row of a verified
    draft (`verify_rows`), and where each pooled request's rows start."""
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sampling_entries: list[int] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)
    verify_entries: list[int] = field(default_factory=list)
    pooling_entries: list[tuple[int, int]] = field(default_factory=list)


def _flat_rows(batch: ScheduledBatch) -> _FlatRows:
    flat = _FlatRows()
    input_ids = flat.input_ids
    for index, entry in enumerate(batch.entries):
        row = len(input_ids)
        if entry.request.pooling is not None:
            input_ids.extend(entry.request.tokens_between(entry.start, entry.end))
            flat.pooling_entries.append((index, row))
        elif entry.drafts:                 # the last token, then the proposed ones
            input_ids.extend(entry.request.tokens_between(entry.start, entry.start + 1))
            input_ids.extend(entry.drafts)
            flat.verify_rows.extend(range(row, row + entry.num_tokens))
            flat.verify_entries.append(index)
        else:
            tokens = entry.request.tokens_between(entry.start, entry.end)
            # a lookahead row's token is still on the device (async batching): placeholder
            input_ids.extend(tokens + [0] * (entry.num_tokens - len(tokens)))
            if entry.samples:
                flat.logits_rows.append(row + entry.num_tokens - 1)
                flat.sampling_entries.append(index)
        flat.positions.extend(range(entry.start, entry.end))
    return flat


def _fast_path_width(batch: ScheduledBatch, blocks_of: BlocksOf, decode_tables: DecodeTables,
                     page_size: int) -> int | None:
    """The fixed table width of a decode-only step on the decode fast path, or None."""
    if any(e.num_tokens != 1 for e in batch.entries):
        return None
    widest = max(len(blocks_of(e.request)) for e in batch.entries)
    return decode_tables.width_for(widest, len(batch.entries), page_size)

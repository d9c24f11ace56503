"""Turn a ScheduledBatch into the flat tensors of one forward pass.

Everything is computed once per step on the host in Python lists, then moved to the
device in a few tensor constructions; layers only index into these tensors. Each
attention group's metadata is of the type its step is read by
(attention/metadata.py): FixedTableMetadata for a decode-only step the decode fast
path takes, FlashMetadata where the backend pages through block tables, else
TorchMetadata. Models with sliding-window layers get a second one (`meta.sliding`)
built over the requests' sliding-group blocks, with the window applied.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..attention.metadata import (AttentionMetadata, FixedTableMetadata, FlashMetadata,
                                 PrefillSlice, TorchMetadata)
from .decode_tables import DecodeTables
from ..core.requests import RequestState
from ..core.scheduler import ScheduledBatch


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


def _slots(block_ids: list[int], page_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions start..end-1 of a request holding `block_ids`."""
    return [block_ids[p // page_size] * page_size + p % page_size for p in range(start, end)]


STEP_QUERY_MAX_PAIRS = 32768
"""Prefill chunks go to the native kernel as one call with the step's other rows when
they average fewer (query, key) pairs than this; longer ones keep an SDPA call each.
Many short chunks in one kernel call save an SDPA call's dispatch each; SDPA's blocked
matmuls win once the chunks are long (docs/cpu-kernels.md, STEP_QUERY_MAX_PAIRS)."""


def build_step_inputs(batch: ScheduledBatch, page_size: int, device: torch.device,
                      sliding_window: int | None = None,
                      sliding_blocks: Callable[[RequestState], list[int]] | None = None,
                      full_layers: bool = True, step_queries: bool = False,
                      paged_tables: bool = False,
                      decode_tables: DecodeTables | None = None) -> StepInputs:
    """`full_layers=False` (every layer slides, as in Mistral) skips the full-attention
    group's metadata, which no layer would read. `step_queries`: the attention backend
    has the native kernel, which can take short prefill chunks as per-row queries
    (TorchMetadata.step_kv_slots). `paged_tables`: the backend reads block tables
    (FlashMetadata) and none of the torch backend's slots and masks.
    `decode_tables`: the decode fast path is on; decode-only steps it accepts get
    fixed-width tables (decode_tables.py), whatever the backend."""
    rows = _flat_rows(batch)

    def group(window: int | None, blocks_of, queries: bool) -> AttentionMetadata:
        width = _fast_path_width(batch, blocks_of, decode_tables, page_size)
        if width is not None:
            return fixed_table_meta(batch, page_size, device, window, blocks_of, width)
        if paged_tables:
            return flash_meta(batch, page_size, device, window, blocks_of)
        return build_group_meta(batch, page_size, device, window, blocks_of, queries)

    meta = None
    if full_layers or sliding_window is None:
        meta = group(None, lambda r: r.block_ids, step_queries)
    if sliding_window is not None:
        sliding = group(sliding_window, sliding_blocks or (lambda r: r.block_ids),
                        step_queries)
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


def _core(batch: ScheduledBatch, page_size: int, device: torch.device,
          window: int | None, blocks_of: Callable[[RequestState], list[int]]) -> dict:
    """The fields every metadata type has (AttentionMetadata), as keywords."""
    slot_mapping: list[int] = []
    for entry in batch.entries:
        slot_mapping.extend(_slots(blocks_of(entry.request), page_size, entry.start, entry.end))
    cu_seqlens_q = list(itertools.accumulate((e.num_tokens for e in batch.entries), initial=0))
    return dict(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
                cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
                seq_lens_k=torch.tensor([e.end for e in batch.entries], dtype=torch.int32,
                                        device=device),
                page_size=page_size, window=window)


def build_group_meta(batch: ScheduledBatch, page_size: int, device: torch.device,
                     window: int | None, blocks_of: Callable[[RequestState], list[int]],
                     step_queries: bool = False) -> TorchMetadata:
    """The torch backend's metadata of one attention group: the layers sharing a
    block table and a window (a key at position k is visible to a query at q when
    q - window < k <= q)."""
    decode_rows: list[int] = []
    decode_tables: list[list[int | None]] = []
    decode_spans: list[tuple[int, int]] = []
    prefills: list[PrefillSlice] = []
    row = 0
    for entry in batch.entries:
        block_ids, start, end = blocks_of(entry.request), entry.start, entry.end
        first_key = 0 if window is None else max(0, end - window)
        if entry.num_tokens == 1:
            decode_rows.append(row)
            decode_tables.append(block_ids)
            decode_spans.append((first_key, end))
        elif entry.drafts:
            # a verify entry's rows are decode queries, row i over positions up to its
            # own (the step writes every row's K/V before any row attends), so the
            # decode paths, native ones included, serve it as they serve decodes
            for offset in range(entry.num_tokens):
                position_end = start + offset + 1
                decode_rows.append(row + offset)
                decode_tables.append(block_ids)
                decode_spans.append((0 if window is None else max(0, position_end - window),
                                     position_end))
        else:
            prefills.append(_prefill_slice(block_ids, page_size, row, start, end, window, device))
        row += entry.num_tokens
    meta = TorchMetadata(**_core(batch, page_size, device, window, blocks_of), prefills=prefills)
    if decode_rows:
        meta = _with_decodes(meta, decode_rows, decode_tables, decode_spans, page_size, device)
    if step_queries and prefills and _short_chunks(batch, window):
        meta = _with_step_queries(meta, batch, blocks_of, page_size, device, window)
    return meta


def _fast_path_width(batch: ScheduledBatch, blocks_of, decode_tables: DecodeTables | None,
                     page_size: int) -> int | None:
    """The fixed table width of a decode-only step on the decode fast path, or None."""
    if decode_tables is None or any(e.num_tokens != 1 for e in batch.entries):
        return None
    widest = max(len(blocks_of(e.request)) for e in batch.entries)
    return decode_tables.width_for(widest, len(batch.entries), page_size)


def _block_table(batch: ScheduledBatch, blocks_of: Callable[[RequestState], list[int | None]],
                 width: int | None, device: torch.device) -> torch.Tensor:
    """[R, W] int32: each request's blocks, padded with block 0 to `width` (None: the
    widest request's); released sliding blocks (None) are 0 too."""
    tables = [[b if b is not None else 0 for b in blocks_of(e.request)] for e in batch.entries]
    width = width or max(len(table) for table in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=device)


def fixed_table_meta(batch: ScheduledBatch, page_size: int, device: torch.device,
                     window: int | None, blocks_of: Callable[[RequestState], list[int | None]],
                     width: int) -> FixedTableMetadata:
    """A decode fast-path step: tables of the fixed `width` (the shape
    flash_attn_with_kvcache and CUDA graphs want)."""
    return FixedTableMetadata(**_core(batch, page_size, device, window, blocks_of),
                              block_table=_block_table(batch, blocks_of, width, device))


def flash_meta(batch: ScheduledBatch, page_size: int, device: torch.device,
               window: int | None, blocks_of: Callable[[RequestState], list[int | None]]
               ) -> FlashMetadata:
    """A varlen step of a backend that pages through block tables."""
    lengths = [e.end for e in batch.entries]
    return FlashMetadata(
        **_core(batch, page_size, device, window, blocks_of),
        block_table=_block_table(batch, blocks_of, None, device),
        cu_seqlens_k=torch.tensor(list(itertools.accumulate(lengths, initial=0)),
                                  dtype=torch.int32, device=device),
        max_seqlen_q=max(e.num_tokens for e in batch.entries), max_seqlen_k=max(lengths))


def _pairs(entry, window: int | None) -> int:
    """(query, key) pairs of an entry's rows: position p sees p + 1 keys, at most
    `window`."""
    if window is None or entry.end <= window:
        return entry.num_tokens * (entry.start + entry.end + 1) // 2
    growing = max(0, window - entry.start)        # rows still inside the first window
    return growing * (2 * entry.start + growing + 1) // 2 + (entry.num_tokens - growing) * window


def _short_chunks(batch: ScheduledBatch, window: int | None = None) -> bool:
    """The prefill chunks average fewer than STEP_QUERY_MAX_PAIRS (query, key) pairs."""
    chunks = [e for e in batch.entries if e.num_tokens > 1]
    return sum(_pairs(e, window) for e in chunks) < STEP_QUERY_MAX_PAIRS * len(chunks)


def _with_step_queries(meta: TorchMetadata, batch: ScheduledBatch,
                       blocks_of: Callable[[RequestState], list[int]], page_size: int,
                       device: torch.device, window: int | None = None) -> TorchMetadata:
    """Every row of the step as one query over its request's context (in a window,
    the window's part, TorchMetadata.step_starts): the native kernel then runs
    decodes and prefill chunks in one call."""
    entries = batch.entries
    firsts = [0 if window is None else max(0, e.start - window + 1) for e in entries]
    slots, _ = _context_slots([blocks_of(e.request) for e in entries],
                              [(first, e.end) for first, e in zip(firsts, entries)], page_size,
                              device)
    rows = [index for index, entry in enumerate(entries) for _ in range(entry.num_tokens)]
    positions = [p for e in entries for p in range(e.start, e.end)]
    keys_from = [0 if window is None else max(0, p - window + 1) for p in positions]
    lengths = [p + 1 - first for p, first in zip(positions, keys_from)]
    starts = None if window is None else torch.tensor(
        [first - firsts[row] for first, row in zip(keys_from, rows)], dtype=torch.long,
        device=device)
    return replace(meta, step_kv_slots=slots,
                   step_slot_rows=torch.tensor(rows, dtype=torch.long, device=device),
                   step_lengths=torch.tensor(lengths, dtype=torch.long, device=device),
                   step_starts=starts)


def _context_slots(tables: list[list[int | None]], spans: list[tuple[int, int]],
                   page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [N, L] of positions spans[n] = [first, end) of the requests holding block
    tables[n] (Python touches blocks, not tokens), each row padded to the longest span
    with its own last slot, and the mask [N, L] of the real ones."""
    width = max(len(t) for t in tables)
    table = torch.tensor([[b if b is not None else 0 for b in t] + [0] * (width - len(t))
                          for t in tables], dtype=torch.long, device=device)      # [N, blocks]
    first = torch.tensor([f for f, _ in spans], dtype=torch.long, device=device)[:, None]
    end = torch.tensor([e for _, e in spans], dtype=torch.long, device=device)[:, None]
    longest = max(e - f for f, e in spans)    # from the host values: no device sync
    positions = first + torch.arange(longest, device=device)[None, :]            # [N, L]
    mask = positions < end                                                       # [N, L]
    positions = torch.minimum(positions, end - 1)
    return table.gather(1, positions // page_size) * page_size + positions % page_size, mask


def _prefill_slice(block_ids: list[int], page_size: int, row: int, start: int, end: int,
                   window: int | None, device: torch.device) -> PrefillSlice:
    num_tokens = end - start
    if start == 0 and (window is None or num_tokens <= window):
        return PrefillSlice(row, row + num_tokens, 0, None, None)
    first_key = 0 if window is None else max(0, start - window + 1)
    kv_slots = torch.tensor(_slots(block_ids, page_size, first_key, end), dtype=torch.long,
                            device=device)
    query_pos = torch.arange(start, end, device=device)[:, None]     # [n, 1]
    key_pos = torch.arange(first_key, end, device=device)[None, :]   # [1, end - first_key]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return PrefillSlice(row, row + num_tokens, start, kv_slots, mask)


def _with_decodes(meta: TorchMetadata, rows: list[int], tables: list[list[int | None]],
                  spans: list[tuple[int, int]], page_size: int,
                  device: torch.device) -> TorchMetadata:
    """Context slots of the decode requests: request d attends positions
    spans[d] = [first_key, end); rows are padded to the longest span with the
    request's own last position, which the mask hides."""
    slots, mask = _context_slots(tables, spans, page_size, device)
    return replace(
        meta,
        decode_rows=torch.tensor(rows, dtype=torch.long, device=device),
        decode_kv_slots=slots,
        decode_mask=mask[:, None, None, :],       # [D, 1, 1, L]: broadcast over heads
        decode_lengths=mask.sum(dim=1),
    )

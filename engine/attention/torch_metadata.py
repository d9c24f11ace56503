"""The torch backend's step metadata (TorchMetadata): per attention group, the cache
slots each decode row reads and the mask of the real ones, each prefill chunk's
context slots and causal (windowed) mask, and, where the native attention kernel
serves the head size and the chunks are short, every row of the step as one query
of that kernel (the step_* fields).

Built once per step and group by TorchMetadataBuilder (torch_backend.py's
`metadata_builder`); Python touches blocks and spans, tensors do the per-token work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .metadata import (BlocksOf, PrefillSlice, ScheduledStep, TorchMetadata, cache_slots,
                       common_fields)

STEP_QUERY_MAX_PAIRS = 32768
"""Prefill chunks go to the native kernel as one call with the step's other rows when
they average fewer (query, key) pairs than this; longer ones keep an SDPA call each.
Many short chunks in one kernel call save an SDPA call's dispatch each; SDPA's blocked
matmuls win once the chunks are long (docs/cpu-kernels.md, STEP_QUERY_MAX_PAIRS)."""


@dataclass(frozen=True)
class TorchMetadataBuilder:
    """`step_queries`: the native attention kernel serves this model's head size, so
    steps of short prefill chunks run as its per-row queries (TorchMetadata.step_*)."""
    page_size: int
    step_queries: bool = False

    def build(self, batch: ScheduledStep, window: int | None, blocks_of: BlocksOf,
              device: torch.device) -> TorchMetadata:
        return build_group_meta(batch, self.page_size, device, window, blocks_of,
                                self.step_queries)


def build_group_meta(batch: ScheduledStep, page_size: int, device: torch.device,
                     window: int | None, blocks_of: BlocksOf,
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
    meta = TorchMetadata(**common_fields(batch, page_size, device, window, blocks_of),
                         prefills=prefills)
    if decode_rows:
        meta = _with_decodes(meta, decode_rows, decode_tables, decode_spans, page_size, device)
    if step_queries and prefills and _short_chunks(batch, window):
        meta = _with_step_queries(meta, batch, blocks_of, page_size, device, window)
    return meta


def _pairs(entry, window: int | None) -> int:
    """(query, key) pairs of an entry's rows: position p sees p + 1 keys, at most
    `window`."""
    if window is None or entry.end <= window:
        return entry.num_tokens * (entry.start + entry.end + 1) // 2
    growing = max(0, window - entry.start)        # rows still inside the first window
    return growing * (2 * entry.start + growing + 1) // 2 + (entry.num_tokens - growing) * window


def _short_chunks(batch: ScheduledStep, window: int | None = None) -> bool:
    """The prefill chunks average fewer than STEP_QUERY_MAX_PAIRS (query, key) pairs."""
    chunks = [e for e in batch.entries if e.num_tokens > 1]
    return sum(_pairs(e, window) for e in chunks) < STEP_QUERY_MAX_PAIRS * len(chunks)


def _with_step_queries(meta: TorchMetadata, batch: ScheduledStep,
                       blocks_of: BlocksOf, page_size: int,
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
    kv_slots = torch.tensor(cache_slots(block_ids, page_size, first_key, end), dtype=torch.long,
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

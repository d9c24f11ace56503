"""Turn a ScheduledBatch into the flat tensors of one forward pass.

Everything is computed once per step on the host in Python lists, then moved to the
device in a few tensor constructions; layers only index into these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.metadata import AttentionMetadata, PrefillSlice
from .scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor          # [T] long
    positions: torch.Tensor          # [T] long
    meta: AttentionMetadata
    logits_rows: torch.Tensor        # [S] long: last row of each request that samples
    sampling_entries: list[int]      # [S] index into batch.entries of each sampling request


def _slots(block_ids: list[int], page_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions start..end-1 of a request holding `block_ids`."""
    return [block_ids[p // page_size] * page_size + p % page_size for p in range(start, end)]


def build_step_inputs(batch: ScheduledBatch, page_size: int, device: torch.device) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens_q = [0]
    seq_lens_k: list[int] = []
    decode_rows: list[int] = []
    decode_slots: list[list[int]] = []
    prefills: list[PrefillSlice] = []
    logits_rows: list[int] = []
    sampling_entries: list[int] = []

    for index, entry in enumerate(batch.entries):
        request, start, end = entry.request, entry.start, entry.end
        row = len(input_ids)
        input_ids.extend(request.tokens_between(start, end))
        positions.extend(range(start, end))
        slot_mapping.extend(_slots(request.block_ids, page_size, start, end))
        cu_seqlens_q.append(row + entry.num_tokens)
        seq_lens_k.append(end)
        if entry.num_tokens == 1:
            decode_rows.append(row)
            decode_slots.append(_slots(request.block_ids, page_size, 0, end))
        else:
            prefills.append(_prefill_slice(request.block_ids, page_size, row, start, end, device))
        if entry.samples:
            logits_rows.append(row + entry.num_tokens - 1)
            sampling_entries.append(index)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
        seq_lens_k=torch.tensor(seq_lens_k, dtype=torch.int32, device=device),
        decode_rows=None, decode_kv_slots=None, decode_mask=None,
        prefills=prefills, page_size=page_size,
        block_tables=[entry.request.block_ids for entry in batch.entries],
    )
    if decode_rows:
        meta = _with_decodes(meta, decode_rows, decode_slots, device)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sampling_entries=sampling_entries,
    )


def _prefill_slice(block_ids: list[int], page_size: int, row: int, start: int, end: int,
                   device: torch.device) -> PrefillSlice:
    num_tokens = end - start
    if start == 0:
        return PrefillSlice(row, row + num_tokens, 0, None, None)
    kv_slots = torch.tensor(_slots(block_ids, page_size, 0, end), dtype=torch.long, device=device)
    query_pos = torch.arange(start, end, device=device)[:, None]     # [n, 1]
    key_pos = torch.arange(end, device=device)[None, :]              # [1, end]
    return PrefillSlice(row, row + num_tokens, start, kv_slots, key_pos <= query_pos)


def _with_decodes(meta: AttentionMetadata, rows: list[int], slots: list[list[int]],
                  device: torch.device) -> AttentionMetadata:
    longest = max(len(s) for s in slots)
    padded = [s + [0] * (longest - len(s)) for s in slots]
    lengths = torch.tensor([len(s) for s in slots], device=device)
    mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]   # [D, L]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping, cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens_k=meta.seq_lens_k,
        decode_rows=torch.tensor(rows, dtype=torch.long, device=device),
        decode_kv_slots=torch.tensor(padded, dtype=torch.long, device=device),
        decode_mask=mask[:, None, None, :],
        prefills=meta.prefills, page_size=meta.page_size, block_tables=meta.block_tables,
    )

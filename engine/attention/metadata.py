"""What every attention layer needs to know about one step's flat batch, built once per
step (not per layer), by the builder of the runner's backend (`MetadataBuilder`:
torch_metadata.py, flash_backend.py) or of the decode fast path (step/batch.py): one
type per way of reading the pages, each with only its own fields.

    AttentionMetadata      the fields every backend reads (base of the three below)
    TorchMetadata          the torch backend's varlen steps: the contexts' slots and
                           masks, the prefill chunks, and the native CPU kernel's
                           per-row queries (torch_backend.py, native_prefill.py, the
                           whole-stack decode calls of models/fast_decode.py and
                           packed_stack.py)
    FlashMetadata          flash-attn's varlen steps over block tables (flash_backend.py)
    FixedTableMetadata     decode-only steps over fixed-width block tables, the decode
                           fast path of both backends and of CUDA graphs
                           (fixed_table_decode.py, cuda_graphs.py)

Which one a step gets is decided per step by its shape and the runner's backend
(its builder, chosen once per runner); a backend takes the types it serves and
refuses the others by name.

The batch is "varlen": the tokens of all scheduled requests are concatenated into one
sequence of T tokens. Request r owns rows `cu_seqlens_q[r]:cu_seqlens_q[r+1]`.

slot_mapping, worked example (page_size 4): a request holding block_ids [7, 2] that
feeds positions 3..5 writes them to slots 7*4+3=31, 2*4+0=8, 2*4+1=9, i.e. position p
goes to block_ids[p // page_size] * page_size + p % page_size of the flattened
[num_blocks * page_size] cache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, Sequence

import torch


@dataclass(frozen=True)
class PrefillSlice:
    """One request that feeds more than one token this step."""

    q_start: int               # first row in the flat batch
    q_end: int                 # one past its last row
    start: int                 # position of its first row (tokens already cached before it)
    kv_slots: torch.Tensor | None
    """[L] cache slots of the context positions (0..start+n-1, or the window's part of
    it); None when start == 0 and no window cuts the chunk (the fresh K/V of this
    step are then the whole context)."""
    mask: torch.Tensor | None
    """[n, L] bool, True = may attend (causal with an offset, and the window); None
    exactly when kv_slots is None."""


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] long: cache slot of every token of the step
    cu_seqlens_q: torch.Tensor          # [R + 1] int32, cumulative query lengths
    seq_lens_k: torch.Tensor            # [R] int32, context length of each request after the step
    page_size: int
    window: int | None = None
    """Sliding window of this group's layers (None: full attention)."""
    sliding: "AttentionMetadata | None" = None
    """The sliding-window group's metadata, on the full group's object, for models
    with sliding layers."""
    decode_fast_path: ClassVar[bool] = False
    """Whether steps of this type are decode-only over fixed-width tables (a trait of
    the type: FixedTableMetadata's)."""


@dataclass(frozen=True, kw_only=True)
class TorchMetadata(AttentionMetadata):
    prefills: list[PrefillSlice]
    decode_rows: torch.Tensor | None = None     # [D] long: rows of requests feeding one token
    decode_kv_slots: torch.Tensor | None = None
    """[D, L] long: cache slots of each decode request's context, padded to the longest
    (L) with the request's own last slot (hidden by decode_mask)."""
    decode_mask: torch.Tensor | None = None     # [D, 1, 1, L] bool, True on real context slots
    decode_lengths: torch.Tensor | None = None
    """[D] long: how many leading entries of each decode_kv_slots row are real
    context (the rest is padding)."""
    step_kv_slots: torch.Tensor | None = None
    """Steps with prefill rows whose chunks are short (the native kernel takes them):
    [R, L] long, the slots of each request's context positions 0..end-1 (in a window,
    from the first one its first row sees), padded like decode_kv_slots. With
    step_slot_rows, step_lengths and step_starts, every row of the step is one query
    of the native attention kernel."""
    step_slot_rows: torch.Tensor | None = None
    """[T] long: the request (row of step_kv_slots) of each row of the step."""
    step_lengths: torch.Tensor | None = None
    """[T] long: the keys each row attends to: its position + 1 (causal), at most the
    window. Worked example: a request at rows 4..6 feeding positions 10..12 has
    step_slot_rows [r, r, r] and step_lengths [11, 12, 13]."""
    step_starts: torch.Tensor | None = None
    """Sliding-window groups: [T] long, the entry of its step_kv_slots row each row's
    keys start at (None: 0). Worked example, window 4: that request's row holds
    positions 7..12 (7 = 10 - 4 + 1, the first key of position 10); step_starts
    [0, 1, 2], step_lengths [4, 4, 4]: position 12 reads positions 9..12."""


@dataclass(frozen=True, kw_only=True)
class FixedTableMetadata(AttentionMetadata):
    block_table: torch.Tensor
    """[R, W] int32, row r the block ids of request r, padded with block 0 to the
    width decode_tables.py chose for the step (never read: past the request's length,
    or outside its window; released sliding blocks are 0 too)."""
    gather: Any = None
    """The backend's per-step gather indices and mask over the tables, built once per
    step with the tables (the backend's `decode_gather`: the torch backend's
    TableGather, fixed_table_decode.py), or None (flash reads the tables itself)."""
    decode_fast_path: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class FlashMetadata(AttentionMetadata):
    block_table: torch.Tensor
    """[R, W] int32, row r the block ids of request r, padded to the widest request
    with block 0 (as FixedTableMetadata's). Worked example (page_size 256): a request
    at position 300 holding blocks [7, 2] reads keys 0..255 from block 7 and 256..300
    from block 2."""
    cu_seqlens_k: torch.Tensor
    """[R + 1] int32, cumulative context lengths after the step."""
    max_seqlen_q: int
    """Longest query run of the step."""
    max_seqlen_k: int
    """Longest context after the step."""


class ScheduledEntry(Protocol):
    """One request's part of a step, as the scheduler plans it (core/scheduler.py's
    ScheduledRequest): positions start..end-1, `num_tokens` rows, and a verify
    entry's drafts."""
    request: Any
    start: int
    num_tokens: int
    drafts: tuple[int, ...]

    @property
    def end(self) -> int: ...


class ScheduledStep(Protocol):
    """A step's entries in batch order (core/scheduler.py's ScheduledBatch)."""
    entries: Sequence[ScheduledEntry]


BlocksOf = Callable[[Any], list]
"""A request -> the block ids of one attention group (its full or its sliding
blocks; a released sliding block is None)."""


class MetadataBuilder(Protocol):
    """Builds one attention group's metadata for a step: the group's layers share a
    block table (`blocks_of`) and a window. Each backend has its own
    (AttentionBackend.metadata_builder); chosen once per runner."""

    def build(self, batch: ScheduledStep, window: int | None, blocks_of: BlocksOf,
              device: torch.device) -> AttentionMetadata: ...


def cache_slots(block_ids: list[int], page_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions start..end-1 of a request holding `block_ids`."""
    return [block_ids[p // page_size] * page_size + p % page_size for p in range(start, end)]


def common_fields(batch: ScheduledStep, page_size: int, device: torch.device,
                  window: int | None, blocks_of: BlocksOf) -> dict:
    """The fields every metadata type has (AttentionMetadata), as keywords."""
    slot_mapping: list[int] = []
    for entry in batch.entries:
        slot_mapping.extend(cache_slots(blocks_of(entry.request), page_size, entry.start,
                                        entry.end))
    cu_seqlens_q = list(itertools.accumulate((e.num_tokens for e in batch.entries), initial=0))
    return dict(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
                cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),
                seq_lens_k=torch.tensor([e.end for e in batch.entries], dtype=torch.int32,
                                        device=device),
                page_size=page_size, window=window)


def block_table(batch: ScheduledStep, blocks_of: BlocksOf, width: int | None,
                device: torch.device) -> torch.Tensor:
    """[R, W] int32: each request's blocks, padded with block 0 to `width` (None: the
    widest request's); released sliding blocks (None) are 0 too."""
    tables = [[b if b is not None else 0 for b in blocks_of(e.request)] for e in batch.entries]
    width = width or max(len(table) for table in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=device)

"""How decode-only steps get fixed-width block tables: the decode fast path.

A decode-only step whose requests all fit `max_width` blocks (max_blocks_per_request)
reads block tables [B, width] (AttentionMetadata.decode_fast_path), a shape set by the
batch size and the width alone, which CUDA graphs can replay (cuda_graphs.py). How the
width is chosen depends on the kernel that reads the tables:

- flash_attn_with_kvcache reads each request only up to its length, so the width costs
  nothing: tables always have `max_width` columns (`round_up=False`);
- the torch backend's fixed-shape decode (attention/fixed_table_decode.py) gathers
  whole tables, so the width follows the step: the widest request's block count
  rounded up to a power of two (or to a multiple of `width_step` blocks), and a step
  whose gather would pass `max_keys` keys takes the varlen path instead.

Worked example (page_size 256, max_width 8, round_up): requests holding 1, 3 and 2
blocks -> widest 3 -> width 4: 3 rows x 4 blocks x 256 = 3,072 keys gathered.

Pure Python: the scheduler side of the engine may use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_TABLE_MAX_BYTES = 1 << 30
"""The torch backend's fixed-shape decode gathers at most this many bytes of K and V
per layer (the rest of a step's decodes take the varlen path)."""


@dataclass(frozen=True)
class DecodeTables:
    max_width: int
    """Blocks per table row at most (max_blocks_per_request, >= 1)."""
    round_up: bool = False
    """Widths follow the step (rounded up), else always max_width."""
    width_step: int = 0
    """With round_up: widths are multiples of this many blocks; 0: powers of two."""
    max_keys: int = 0
    """With round_up: at most this many keys (rows x width x page_size); 0: no cap."""

    def __post_init__(self) -> None:
        if self.max_width < 1 or self.width_step < 0 or self.max_keys < 0:
            raise ValueError(f"invalid decode tables {self}")

    def widths(self) -> list[int]:
        """Every width a step can get, smallest first."""
        if not self.round_up:
            return [self.max_width]
        if self.width_step:
            return list(range(self.width_step, self.max_width, self.width_step)) + [self.max_width]
        widths = []
        while (width := 2 ** len(widths)) < self.max_width:
            widths.append(width)
        return widths + [self.max_width]

    def width_for(self, widest: int, num_requests: int, page_size: int) -> int | None:
        """The table width of a decode-only step of `num_requests` requests whose
        largest holds `widest` blocks, or None when the step is not for the fast path."""
        if widest < 1 or widest > self.max_width:
            return None
        width = next(w for w in self.widths() if w >= widest)
        if self.round_up and self.max_keys and num_requests * width * page_size > self.max_keys:
            return None
        return width


def decode_tables_for(backend_reads_lengths: bool, max_blocks_per_request: int,
                      page_size: int, kv_padding_interval_size: int,
                      bytes_per_key: int) -> DecodeTables:
    """The policy for a backend: flash (`backend_reads_lengths`) gets the full width;
    the torch backend rounds widths up (to kv_padding_interval_size tokens when set)
    and caps its gather at FIXED_TABLE_MAX_BYTES (`bytes_per_key`: K and V of one
    position of one layer)."""
    if backend_reads_lengths:
        return DecodeTables(max_blocks_per_request)
    step = -(-kv_padding_interval_size // page_size) if kv_padding_interval_size else 0
    return DecodeTables(max_blocks_per_request, round_up=True, width_step=step,
                        max_keys=max(1, FIXED_TABLE_MAX_BYTES // max(1, bytes_per_key)))

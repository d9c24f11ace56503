"""GGUF blocks repacked for products on int8 activations (dtype int8-activations).

The int8 kernels (engine/kernels/block_int8.c) quantize each step's activations to
int8 per block of 32 (a scale per block, as llama.cpp does) and sum code products in
int32 with VNNI. They read the weights in groups of 16 output columns, one column per
vector lane, so each form is laid out anew at load (the native parser writes these
forms straight from the file, kernels/block_parse.c):

    form      from            codes                                  scales, minima
    I8_Q4     Q4_1            the 16 code bytes of a block, dword    d, m
                              t of column j at lane j of vector t
    I8_U8     Q8_0, Q5_1      the 32 code bytes as unsigned (Q8_0:   d, m (Q8_0: -128 d)
                              + 128), dword t at lane j of vector t
    I8_U8_16  Q8_16           as I8_U8                               per 16: d, -128 d

Every form is then w = d * c + m with unsigned codes c. The tensors keep their
source's shapes ([N, K/2] or [N, K] codes, [N, K/32] or [N, K/16] scales), in the
group order [N/16, K/32, vectors, 16 lanes, 4 bytes]; N must be a multiple of 16.
"""

from __future__ import annotations

import torch

from ..kernels.block_types import INT8_FORM_OF
from .block_formats import BLOCK, Blocks

LANES = 16
"""Columns per group: the lanes of the kernels' vectors."""


def to_int8_form(blocks: Blocks) -> "Int8Blocks":
    """`blocks` (of a form in INT8_FORM_OF, N a multiple of 16) repacked for the int8
    kernels, with torch's ops: a copy. Loading writes these forms straight from the
    file (kernels/block_parse.c); this is the reference its output is tested against."""
    kind = blocks.kind
    codes = blocks.codes.view(torch.uint8)
    if kind in ("Q8_0", "Q8_16"):
        codes = codes ^ 0x80                   # signed q -> unsigned q + 128
    minima = blocks.minima if blocks.minima is not None else -128.0 * blocks.scales
    return Int8Blocks(INT8_FORM_OF[kind], _interleave_codes(codes),
                      _interleave_scales(blocks.scales), _interleave_scales(minima))


class Int8Blocks(Blocks):
    """Blocks in an int8-activation form: the same fields, in group order."""

    @property
    def shape(self) -> tuple[int, int]:
        group = 16 if self.kind == "I8_U8_16" else BLOCK
        return self.codes.shape[0], self.scales.shape[1] * group

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 of d * c + m: for steps the kernels do not take (another dtype
        or device, a traced step)."""
        return self.dequantize_rows(torch.arange(self.codes.shape[0]))

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [T] of the weight, [T, K] fp32 (a tied table's lookups)."""
        groups, lanes = index // LANES, index % LANES
        n, width = self.codes.shape
        codes = self.codes.view(n // LANES, -1, LANES, 4)[groups, :, lanes].reshape(-1, width)
        if self.kind == "I8_Q4":
            nibbles = codes.view(codes.shape[0], -1, BLOCK // 2)
            codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
        scales, minima = (values.view(n // LANES, -1, LANES)[groups, :, lanes]
                          for values in (self.scales, self.minima))
        group = 16 if self.kind == "I8_U8_16" else BLOCK
        values = codes.reshape(codes.shape[0], -1, group).float()
        return (scales[..., None] * values + minima[..., None]).reshape(codes.shape[0], -1)

    def rows(self, index: torch.Tensor) -> Blocks:
        raise TypeError("int8-activation blocks are kept in column groups: use dequantize_rows")

    def row_range(self, start: int, stop: int) -> "Int8Blocks":
        """Rows [start, stop), both multiples of 16: views of whole groups."""
        if start % LANES or stop % LANES:
            raise ValueError(f"rows [{start}, {stop}) cut a group of {LANES} columns")
        return Int8Blocks(self.kind, self.codes[start:stop], self.scales[start:stop],
                          self.minima[start:stop])


def empty_int8_blocks(form: str, rows: int, row_length: int) -> Int8Blocks:
    """Int8Blocks repacked from kernel form `form` (INT8_FORM_OF), for `rows` rows (a
    multiple of 16) of `row_length` weights, not yet written (the native parser fills
    them)."""
    group = 16 if form == "Q8_16" else BLOCK
    width = row_length // 2 if form == "Q4_1" else row_length
    return Int8Blocks(INT8_FORM_OF[form], torch.empty(rows, width, dtype=torch.uint8),
                      torch.empty(rows, row_length // group),
                      torch.empty(rows, row_length // group))


def _interleave_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, bytes] (a row: K/32 blocks of equal bytes) -> the group order, same shape."""
    n, width = codes.shape
    dwords = codes.view(n // LANES, LANES, -1, 4)         # [G, lane, block dwords, 4]
    return dwords.permute(0, 2, 1, 3).contiguous().view(n, width)


def _interleave_scales(values: torch.Tensor) -> torch.Tensor:
    """[N, groups] fp32 -> [N/16, groups, 16] (lane j: column j of the group), as [N, groups]."""
    n, width = values.shape
    return values.reshape(n // LANES, LANES, width).transpose(1, 2).contiguous().view(n, width)

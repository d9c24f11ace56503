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

Where the build's int8 loop has a tile for them (AT_WIDTH_LOOPS), tensors keep their
file's width. GGUF's types of one fp16 scale a block keep those scales (and Q4_1's
fp16 minima), widened in the kernel; a minimum not stored is a multiple of the scale
(the table's `implied_minimum`), the one the wide forms store:

    form      from            codes             scales, minima (fp16, group order)
    I8_Q4_0   Q4_0            as I8_Q4          d; m = -8 d
    I8_Q4_1   Q4_1            as I8_Q4          d, m
    I8_Q8_0   Q8_0, Q5_0      as I8_U8          d; m = -128 d

Q4_K and Q6_K files keep theirs in the super-block forms (SuperBlocks):

    form      from    codes                          scales          minima (bytes)
    I8_Q4K    Q4_K    as I8_Q4, [N, K/2]             d, dmin per     scale, minimum
                                                     256 [N, K/128]  per 32 [N, K/16]
    I8_Q6K    Q6_K    low 4 bits as I8_Q4, then the  d per 256       int8 scale per
                      high 2 bits, [N, 3K/4]         [N, K/256]      16 [N, K/16]

A block's scale is then d * scale (and I8_Q4K's minimum -(dmin * minimum)): the wide
forms' values to the bit, formed in the kernel as a block is read.
"""

from __future__ import annotations

import torch

from ..kernels.block_types import FORM_OF, FORMS, INT8_AT_WIDTH, INT8_FORM_OF
from .block_formats import BLOCK, SUPER_BLOCK, Blocks

LANES = 16
"""Columns per group: the lanes of the kernels' vectors."""

AT_WIDTH_LOOPS = ("avx2",)
"""The int8 loops (native.py's INT8_PATHS) with a vector tile for the forms at a
file's width (the fp16 and super-block forms); the others multiply them one column at
a time, so there the wide forms serve."""


def int8_form_for(gguf_kind: str, int8_loop: str) -> str:
    """The int8-activation form a tensor of GGUF type `gguf_kind` is read into on a
    build whose int8 loop is `int8_loop`."""
    if int8_loop in AT_WIDTH_LOOPS and gguf_kind in INT8_AT_WIDTH:
        return INT8_AT_WIDTH[gguf_kind]
    return INT8_FORM_OF[FORM_OF[gguf_kind]]


def to_int8_form(blocks: Blocks) -> "Int8Blocks":
    """`blocks` (of a form in INT8_FORM_OF, N a multiple of 16) repacked for the int8
    kernels, with torch's ops: a copy. Loading writes these forms straight from the
    file (kernels/block_parse.c); this is the reference its output is tested against."""
    kind = blocks.kind
    codes = blocks.codes.view(torch.uint8)
    if not FORMS[kind].minima:                 # the forms of signed codes (Q8_0, Q8_16)
        codes = codes ^ 0x80                   # signed q -> unsigned q + 128
    minima = blocks.minima if blocks.minima is not None else -128.0 * blocks.scales
    return Int8Blocks(INT8_FORM_OF[kind], _interleave_codes(codes),
                      _interleave_scales(blocks.scales), _interleave_scales(minima))


class Int8Blocks(Blocks):
    """Blocks in an int8-activation form: the same fields, in group order."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scales.shape[1] * FORMS[self.kind].scale_group

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 of d * c + m: for steps the kernels do not take (another dtype
        or device, a traced step)."""
        return self.dequantize_rows(torch.arange(self.codes.shape[0]))

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [T] of the weight, [T, K] fp32 (a tied table's lookups)."""
        groups, lanes = index // LANES, index % LANES
        n, width = self.codes.shape
        codes = self.codes.view(n // LANES, -1, LANES, 4)[groups, :, lanes].reshape(-1, width)
        if FORMS[self.kind].code_bits == 4:
            nibbles = codes.view(codes.shape[0], -1, BLOCK // 2)
            codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
        scales = self.scales.view(n // LANES, -1, LANES)[groups, :, lanes].float()
        implied = FORMS[self.kind].implied_minimum
        minima = implied * scales if implied else \
            self.minima.view(n // LANES, -1, LANES)[groups, :, lanes].float()
        values = codes.reshape(codes.shape[0], -1, FORMS[self.kind].scale_group).float()
        return (scales[..., None] * values + minima[..., None]).reshape(codes.shape[0], -1)

    def rows(self, index: torch.Tensor) -> Blocks:
        raise TypeError("int8-activation blocks are kept in column groups: use dequantize_rows")

    def row_range(self, start: int, stop: int) -> "Int8Blocks":
        """Rows [start, stop), both multiples of 16: views of whole groups."""
        if start % LANES or stop % LANES:
            raise ValueError(f"rows [{start}, {stop}) cut a group of {LANES} columns")
        return Int8Blocks(self.kind, self.codes[start:stop], self.scales[start:stop],
                          None if self.minima is None else self.minima[start:stop])


def empty_int8_blocks(int8_form: str, rows: int, row_length: int) -> Int8Blocks:
    """Int8Blocks of form `int8_form` (an I8_* form) for `rows` rows (a multiple of
    16) of `row_length` weights, not yet written (the native parser fills them)."""
    traits = FORMS[int8_form]
    codes = torch.empty(rows, row_length * traits.code_bits // 8, dtype=torch.uint8)
    if traits.super_block:         # fp32 d (and dmin, with minima) per super-block
        scales_per_super = 2 if traits.minima else 1
        return SuperBlocks(int8_form, codes,
                           torch.empty(rows, row_length // traits.super_block * scales_per_super),
                           torch.empty(rows, row_length // 16, dtype=torch.uint8))
    groups = row_length // traits.scale_group
    dtype = torch.float16 if traits.scale_bits == 16 else torch.float32
    minima = None if traits.implied_minimum else torch.empty(rows, groups, dtype=dtype)
    return Int8Blocks(int8_form, codes, torch.empty(rows, groups, dtype=dtype), minima)


class SuperBlocks(Int8Blocks):
    """Blocks in a super-block form (I8_Q4K, I8_Q6K): `scales` holds the fp32
    super-block scales, `minima` the integer sub-scales (bytes), in group order."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.minima.shape[1] * 16

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [T] of the weight, [T, K] fp32: the wide form's values."""
        groups, lanes = index // LANES, index % LANES
        n, k = self.shape
        g, blocks = n // LANES, k // BLOCK
        per_block = self.codes.view(g, blocks, -1)                   # [G, B, block bytes]
        low = per_block[..., :256].reshape(g, blocks, 4, LANES, 4)[groups, :, :, lanes]
        nibbles = low.reshape(-1, blocks, 16)                        # [T, B, byte 4t + i]
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int32)  # [T, B, 32]
        sub = self.minima.view(g, blocks, 2, LANES)[groups, :, :, lanes]           # [T, B, 2]
        if FORMS[self.kind].minima:                                  # I8_Q4K: d * q - m
            sup = self.scales.view(g, -1, 2, LANES)[groups, :, :, lanes]            # [T, S, 2]
            sup = sup.repeat_interleave(SUPER_BLOCK // BLOCK, dim=1)                # [T, B, 2]
            d = sup[..., 0] * sub[..., 0].float()
            m = -(sup[..., 1] * sub[..., 1].float())
            return (d[..., None] * codes.float() + m[..., None]).reshape(-1, k)
        high = per_block[..., 256:].reshape(g, blocks, 2, LANES, 4)[groups, :, :, lanes]
        shifts = (2 * torch.arange(4, dtype=torch.int32)).view(4, 1)               # [t, 1]
        high = (high[:, :, :, None, :].to(torch.int32) >> shifts) & 3              # [T, B, u, t, i]
        codes = codes | (high.reshape(-1, blocks, 32) << 4)          # element 16 u + 4 t + i
        sup = self.scales.view(g, -1, LANES)[groups, :, lanes]                      # [T, S]
        d = sup.repeat_interleave(SUPER_BLOCK // 16, dim=1).view(-1, blocks, 2)
        d = d * sub.view(torch.int8).float()
        values = (codes - 32).float().view(-1, blocks, 2, 16)
        return (d[..., None] * values).reshape(-1, k)

    def row_range(self, start: int, stop: int) -> "SuperBlocks":
        part = super().row_range(start, stop)
        return SuperBlocks(part.kind, part.codes, part.scales, part.minima)


def _interleave_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, bytes] (a row: K/32 blocks of equal bytes) -> the group order, same shape."""
    n, width = codes.shape
    dwords = codes.view(n // LANES, LANES, -1, 4)         # [G, lane, block dwords, 4]
    return dwords.permute(0, 2, 1, 3).contiguous().view(n, width)


def _interleave_scales(values: torch.Tensor) -> torch.Tensor:
    """[N, groups] fp32 -> [N/16, groups, 16] (lane j: column j of the group), as [N, groups]."""
    n, width = values.shape
    return values.reshape(n // LANES, LANES, width).transpose(1, 2).contiguous().view(n, width)

"""GGUF weight blocks read into the four forms the block kernels multiply.

The kernels (engine/kernels/block_gemm.c) know four forms, each a weight row of K
values as codes and fp32 scales:

    Q4_1   4-bit codes q in 0..15, a scale d and a minimum m per 32:  w = d * q + m
    Q5_1   codes q in 0..31, a byte each, d and m per 32:            w = d * q + m
    Q8_0   int8 codes q, a scale d per 32:                           w = d * q
    Q8_16  int8 codes q, a scale d per 16:                           w = d * q

Every GGUF type read here converts to one of them without changing a single weight:

    GGUF type  bytes / weights  stored as                           form
    Q4_0       18 / 32          d; 4-bit q:         w = d (q - 8)     Q4_1, m = -8 d
    Q4_1       20 / 32          d, m; 4-bit q:      w = d q + m       Q4_1
    Q5_0       22 / 32          d; 5-bit q:         w = d (q - 16)    Q8_0, codes q - 16
    Q5_1       24 / 32          d, m; 5-bit q:      w = d q + m       Q5_1
    Q8_0       34 / 32          d; int8 q:          w = d q           Q8_0
    Q4_K       144 / 256        d, dmin; 6-bit sc, mn per 32; 4-bit q:
                                w = (d sc) q - (dmin mn)             Q4_1, per 32:
                                                                     d sc and -dmin mn
    Q5_K       176 / 256        as Q4_K, 5-bit q:
                                w = (d sc) q - (dmin mn)             Q5_1, per 32 as Q4_K
    Q6_K       210 / 256        d; int8 sc per 16; 6-bit q:
                                w = (d sc) (q - 32)                  Q8_16, codes q - 32

Each product above is exact in fp32 (an fp16 scale has 11 significant bits, times a
code or a 6- or 8-bit sub-scale stays within fp32's 24), so `Blocks.dequantize` gives
gguf-py's dequantized values bit for bit, which block_weights.py checks against the
loaded weights before it installs a projection.

Worked example of the nibble layouts. Q4_1 (and Q4_0) keep element j of a 32-block in
the low nibble of byte j and element j + 16 in its high nibble. Q4_K's 128 code
bytes hold four 64-weight chunks: byte 32 c + i carries element 64 c + i in its low
nibble and element 64 c + 32 + i in its high one. So element 40 of a Q4_K block
(c = 0, high nibble of byte 8) is element 8 of 32-block 1, and lands in the low nibble
of that block's byte 8 in the Q4_1 form. Q5_K's 128 code bytes are laid out as
Q4_K's, and the fifth bit of element 64 c + 32 h + i is bit 2 c + h of its byte 32 + i
(of the 32 bytes before the codes); Q5_1 and Q5_0 keep bit j of their 32-bit word for
element j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.block_types import BYTES_PER_BLOCK, FORM_OF, FORMS  # noqa: F401 (the one table)

BLOCK = 32
SUPER_BLOCK = 256


@dataclass
class Blocks:
    kind: str                  # the kernel form: "Q4_1", "Q5_1", "Q8_0" or "Q8_16"
    codes: torch.Tensor        # Q4_1: [N, K/2] uint8 nibbles; Q5_1 (0..31), Q8_0, Q8_16: [N, K] int8
    scales: torch.Tensor       # [N, K/32] fp32 ([N, K/16] for Q8_16)
    minima: torch.Tensor | None  # Q4_1, Q5_1: [N, K/32] fp32

    @property
    def shape(self) -> tuple[int, int]:
        """(rows N, row length K) of the weight the blocks hold."""
        return self.codes.shape[0], self.scales.shape[1] * FORMS[self.kind].scale_group

    def rows(self, index: torch.Tensor) -> "Blocks":
        return Blocks(self.kind, self.codes[index], self.scales[index],
                      None if self.minima is None else self.minima[index])

    def row_range(self, start: int, stop: int) -> "Blocks":
        """Rows [start, stop) as views of these blocks' tensors."""
        return Blocks(self.kind, self.codes[start:stop], self.scales[start:stop],
                      None if self.minima is None else self.minima[start:stop])

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [T] of the weight, [T, K] fp32 (an embedding's lookups)."""
        return self.rows(index).dequantize()

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, computed as gguf-py does (d * q + m, in fp32)."""
        n, traits = self.codes.shape[0], FORMS[self.kind]
        codes = self.codes
        if traits.code_bits == 4:              # each 32-block: low nibbles, then high
            nibbles = codes.view(n, -1, BLOCK // 2)
            codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)       # [N, K/32, 32]
        values = self.scales[..., None] * codes.reshape(n, -1, traits.scale_group).float()
        if self.minima is not None:
            values = values + self.minima[..., None]
        return values.reshape(n, -1)


def concat(parts: list[Blocks]) -> Blocks:
    """The parts' rows in order, as one Blocks: views of one buffer where the parts are
    consecutive row ranges of it (as parse_blocks_into leaves a fused projection's
    parts), else a copy."""
    fields = [[p.codes for p in parts], [p.scales for p in parts]]
    if parts[0].minima is not None:
        fields.append([p.minima for p in parts])
    joined = [_adjacent(tensors) for tensors in fields]
    if any(tensor is None for tensor in joined):
        joined = [torch.cat(tensors) for tensors in fields]
    return type(parts[0])(parts[0].kind, joined[0], joined[1],
                          joined[2] if len(joined) > 2 else None)


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over `tensors` where they are contiguous row ranges, back to back, of
    one storage; else None."""
    first, offset = tensors[0], tensors[0].storage_offset()
    for tensor in tensors:
        if (tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or tensor.storage_offset() != offset or not tensor.is_contiguous()
                or tensor.shape[1:] != first.shape[1:]):
            return None
        offset += tensor.numel()
    rows = sum(tensor.shape[0] for tensor in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def empty_blocks(form: str, rows: int, row_length: int) -> Blocks:
    """Blocks of kernel form `form` for `rows` rows of `row_length` weights, not yet
    written (parse_blocks_into fills them)."""
    traits = FORMS[form]
    codes = torch.empty(rows, row_length * traits.code_bits // 8,
                        dtype=torch.uint8 if traits.code_bits == 4 else torch.int8)
    minima = torch.empty(rows, row_length // BLOCK) if traits.minima else None
    return Blocks(form, codes, torch.empty(rows, row_length // traits.scale_group), minima)


def _copy_q8_0(blocks: torch.Tensor, target: Blocks) -> None:
    target.codes.view(blocks.shape[:2] + (BLOCK,)).copy_(blocks[..., 2:].view(torch.int8))


def _copy_q4_0(blocks: torch.Tensor, target: Blocks) -> None:
    target.codes.view(blocks.shape[:2] + (BLOCK // 2,)).copy_(blocks[..., 2:])
    torch.mul(target.scales, -8, out=target.minima)


def _copy_q4_1(blocks: torch.Tensor, target: Blocks) -> None:
    target.minima.copy_(blocks[..., 2:4].view(torch.float16).squeeze(-1))
    target.codes.view(blocks.shape[:2] + (BLOCK // 2,)).copy_(blocks[..., 4:])


DIRECT_COPIES = {"Q4_0": _copy_q4_0, "Q4_1": _copy_q4_1, "Q8_0": _copy_q8_0}
"""GGUF types whose blocks parse_blocks_into copies straight into place (their kernel
form keeps the file's codes byte for byte, scales widened to fp32): the codes' and
minima's copy, after the scales' (bytes 0-1 of every block of these types)."""


def parse_blocks_into(kind: str, raw: torch.Tensor, out: Blocks, start: int,
                      order: torch.Tensor | None = None) -> None:
    """Parse GGUF bytes [N, row bytes] of type `kind` into rows [start, start + N) of
    `out` (blocks of kind's form, as empty_blocks makes), in row order `order` when
    given: the same values parse_blocks gives, without an intermediate copy for
    DIRECT_COPIES' types in file order."""
    n = raw.shape[0]
    target = out.row_range(start, start + n)
    if kind not in DIRECT_COPIES or order is not None:
        parsed = parse_blocks(kind, raw)
        parsed = parsed if order is None else parsed.rows(order)
        target.codes.copy_(parsed.codes)
        target.scales.copy_(parsed.scales)
        if target.minima is not None:
            target.minima.copy_(parsed.minima)
        return
    blocks = raw.reshape(n, -1, BYTES_PER_BLOCK[kind])              # [N, B, bytes]
    target.scales.copy_(blocks[..., 0:2].view(torch.float16).squeeze(-1))
    DIRECT_COPIES[kind](blocks, target)


def _fp16_field(raw: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes [start, stop) of every block read as fp16, as fp32 [N, blocks]."""
    return raw[..., start:stop].contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles_as_q4_1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15, element order) -> Q4_1 bytes [N, K/2]."""
    n = codes.shape[0]
    pairs = codes.view(n, -1, 2, BLOCK // 2)         # [N, K/32, low half | high half, 16]
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's per-32 scales d * sc and minima -(dmin * mn), fp32 [N, S * 8],
    from the first 16 bytes of each 256-weight block [N, S, bytes]."""
    n, supers = raw.shape[0], raw.shape[1]
    d, dmin = _fp16_field(raw, 0, 2), _fp16_field(raw, 2, 4)            # [N, S]
    packed = raw[..., 4:16].view(n, supers, 3, 4).to(torch.int32)
    low, mid, high = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    sub_scales = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)  # [N, S, 8]
    sub_minima = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    scales = (d[..., None] * sub_scales.float()).reshape(n, -1)
    minima = -(dmin[..., None] * sub_minima.float()).reshape(n, -1)
    return scales, minima


def _k_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """128 code bytes per 256 weights [N, S, 128] -> 4-bit codes [N, S, 4, 2, 32]
    (chunk c, low then high nibbles, byte i): element 64 c + 32 h + i."""
    n, supers = codes.shape[0], codes.shape[1]
    chunks = codes.reshape(n, supers, 4, 1, 32)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=3)


def _q4_k(raw: torch.Tensor) -> Blocks:
    n = raw.shape[0]
    scales, minima = _k_scales(raw)
    codes = _k_nibbles(raw[..., 16:])                                    # [N, S, 4, 2, 32]
    return Blocks("Q4_1", _nibbles_as_q4_1(codes.reshape(n, -1)), scales, minima)


def _q5_k(raw: torch.Tensor) -> Blocks:
    n = raw.shape[0]
    scales, minima = _k_scales(raw)
    high = raw[..., 16:48][:, :, None, None, :]                          # [N, S, 1, 1, 32]
    shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1)          # bit 2 c + h
    codes = _k_nibbles(raw[..., 48:]) | (((high >> shifts) & 1) << 4)
    return Blocks("Q5_1", codes.reshape(n, -1).to(torch.int8), scales, minima)


def _fifth_bits(raw: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0's and Q5_1's fifth bits: bytes [start, start + 4) of each block, a 32-bit
    word whose bit j belongs to element j, as [N, B, 32] uint8 shifted to bit 4."""
    words = raw[..., start:start + 4].contiguous().view(torch.int32)        # [N, B, 1]
    return (((words >> torch.arange(32, dtype=torch.int32)) & 1) << 4).to(torch.uint8)


def _nibble_pairs(nibbles: torch.Tensor) -> torch.Tensor:
    """16 bytes per 32-block [N, B, 16] -> codes [N, B, 32]: low nibbles, then high."""
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)


def _q6_k(raw: torch.Tensor) -> Blocks:
    n, supers = raw.shape[0], raw.shape[1]
    low = raw[..., :128].reshape(n, supers, 2, 1, 64)                # per 128-weight half
    low = torch.cat([low & 0x0F, low >> 4], dim=3)                   # [N, S, 2, 2, 64]
    high = raw[..., 128:192].reshape(n, supers, 2, 1, 32)
    high = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)   # [.., 4, 32]
    codes = (low.reshape(n, -1) | (high.reshape(n, -1) << 4)).to(torch.int8) - 32
    sub_scales = raw[..., 192:208].contiguous().view(torch.int8).float()   # [N, S, 16]
    scales = (_fp16_field(raw, 208, 210)[..., None] * sub_scales).reshape(n, -1)
    return Blocks("Q8_16", codes, scales, None)


def _q5_0(raw: torch.Tensor) -> Blocks:
    n = raw.shape[0]
    codes = (_nibble_pairs(raw[..., 6:]) | _fifth_bits(raw, 2)).to(torch.int8) - 16
    return Blocks("Q8_0", codes.reshape(n, -1), _fp16_field(raw, 0, 2), None)


def _q5_1(raw: torch.Tensor) -> Blocks:
    n = raw.shape[0]
    codes = (_nibble_pairs(raw[..., 8:]) | _fifth_bits(raw, 4)).to(torch.int8)
    return Blocks("Q5_1", codes.reshape(n, -1), _fp16_field(raw, 0, 2), _fp16_field(raw, 2, 4))


def _q8_0(raw: torch.Tensor) -> Blocks:
    n = raw.shape[0]
    return Blocks("Q8_0", raw[..., 2:].contiguous().view(torch.int8).reshape(n, -1),
                  _fp16_field(raw, 0, 2), None)


def _q4_0(raw: torch.Tensor) -> Blocks:
    scales = _fp16_field(raw, 0, 2)
    return Blocks("Q4_1", raw[..., 2:].reshape(raw.shape[0], -1).contiguous(), scales,
                  -8 * scales)


def _q4_1(raw: torch.Tensor) -> Blocks:
    return Blocks("Q4_1", raw[..., 4:].reshape(raw.shape[0], -1).contiguous(),
                  _fp16_field(raw, 0, 2), _fp16_field(raw, 2, 4))


TORCH_PARSERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
                 "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
"""GGUF type -> its blocks [N, B, block bytes] parsed with torch's ops into its kernel
form (block_types.FORM_OF): the reference block_parse.c is tested against."""


def parse_blocks(kind: str, raw: torch.Tensor) -> Blocks:
    """GGUF bytes [N, row bytes] uint8 of GGUF type `kind` (BYTES_PER_BLOCK) -> Blocks
    in that type's kernel form (FORM_OF)."""
    return TORCH_PARSERS[kind](raw.reshape(raw.shape[0], -1, BYTES_PER_BLOCK[kind]))

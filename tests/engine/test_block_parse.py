"""The native GGUF parser (kernels/block_parse.c) against torch's (block_formats.py):
every type, into its fp32 kernel form and its int8-activation form, in file order and
reordered, at an offset into a joined buffer: equal bit for bit. Scales include
fp16 zeros, negatives and subnormals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.block_formats import BYTES_PER_BLOCK, FORM_OF, empty_blocks, parse_blocks
from engine.models.gguf_checkpoint import BlockParsing
from engine.kernels.block_types import INT8_FORM_OF
from engine.models.int8_blocks import Int8Blocks, empty_int8_blocks, to_int8_form
from tests.engine.test_block_formats import FP16_FIELDS, kernels, random_blocks  # noqa: F401

ROWS, COLS = 48, 512


def with_odd_scales(kind: str, raw: np.ndarray) -> np.ndarray:
    """raw with a zero, a negative and a subnormal fp16 in its first blocks' scales."""
    blocks = raw.reshape(ROWS, -1, BYTES_PER_BLOCK[kind]).copy()
    offset = FP16_FIELDS[kind][0]
    for row, value in ((0, 0.0), (1, -0.0125), (2, 3e-6), (3, -5e-7)):
        blocks[row, 0, offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
    return blocks.reshape(ROWS, -1)


def assert_same_blocks(got, want) -> None:
    assert got.kind == want.kind
    for name in ("codes", "scales", "minima"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a,
                               b.view(torch.uint8) if b.dtype == torch.int8 else b), name


@pytest.mark.parametrize("kind", sorted(FORM_OF))
@pytest.mark.parametrize("reordered", [False, True])
@pytest.mark.parametrize("int8", [False, True], ids=["kernel-form", "int8-form"])
def test_native_parse_equals_torch(kernels, kind, reordered, int8):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, COLS, seed=3)))
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)) if reordered else None
    want = parse_blocks(kind, raw)
    want = want.rows(order) if reordered else want
    want = to_int8_form(want) if int8 else want
    ahead = 16 if int8 else 32                            # a first part's rows before
    form = INT8_FORM_OF[FORM_OF[kind]] if int8 else FORM_OF[kind]
    out = (empty_int8_blocks if int8 else empty_blocks)(form, ahead + ROWS, COLS)
    kernels.parse_gguf(kind, raw, out, ahead, order)
    assert_same_blocks(out.row_range(ahead, ahead + ROWS), want)


def test_rows_in_whole_groups_are_parsed_into_the_int8_forms(kernels):  # noqa: F811
    parsing = BlockParsing(kernels, int8_activations=True)
    whole = parsing.empty("Q4_K", [16, 32], 256)
    assert isinstance(whole, Int8Blocks)
    assert whole.kind == ("I8_Q4K" if kernels.int8_path == "avx2" else "I8_Q4")
    cut = parsing.empty("Q4_K", [16, 24], 256)          # 24 rows cut a group: kernel form
    assert not isinstance(cut, Int8Blocks) and cut.kind == "Q4_1"


def test_int8_forms_refuse_rows_that_cut_a_group(kernels):  # noqa: F811
    raw = torch.from_numpy(random_blocks("Q8_0", ROWS, COLS, seed=5))
    with pytest.raises(ValueError, match="cannot parse 48 Q8_0 rows"):
        kernels.parse_gguf("Q8_0", raw, empty_int8_blocks("I8_U8", 64, COLS), 8, None)


@pytest.mark.parametrize("damage", ["order past raw", "negative order", "short raw rows",
                                    "row bytes for other k", "rows past out", "negative start"])
def test_the_native_parser_refuses_ranges_outside_its_buffers(kernels, damage):  # noqa: F811
    """The checks before the parser (gguf_check.py, the tensor shapes) are proven
    again in C: a range outside raw or out is a ValueError, and nothing is read."""
    kind = "Q4_K"
    raw = torch.from_numpy(random_blocks(kind, ROWS, COLS, seed=5))
    out = empty_blocks(FORM_OF[kind], ROWS, COLS)
    order, start = None, 0
    if damage == "order past raw":
        order = torch.arange(ROWS, dtype=torch.int64)
        order[7] = ROWS + 10**9
    elif damage == "negative order":
        order = torch.arange(ROWS, dtype=torch.int64)
        order[3] = -1
    elif damage == "short raw rows":
        order = torch.arange(ROWS, dtype=torch.int64)
        raw = raw[:ROWS - 1]
    elif damage == "row bytes for other k":
        raw = raw[:, :raw.shape[1] // 2].contiguous()
    elif damage == "rows past out":
        start = 8
    elif damage == "negative start":
        start = -16
    before = out.codes.clone()
    with pytest.raises(ValueError, match="cannot parse"):
        kernels.parse_gguf(kind, raw, out, start, order)
    assert torch.equal(out.codes, before)

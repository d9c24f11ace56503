"""The native GGUF parser (kernels/block_parse.c) against torch's (block_formats.py):
every type, into its fp32 kernel form and its int8-activation form, in file order and
reordered, at an offset into a joined buffer: equal bit for bit. Scales include
fp16 zeros, negatives and subnormals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.block_formats import BYTES_PER_BLOCK, FORM_OF, empty_blocks, parse_blocks
from engine.models.int8_blocks import empty_int8_blocks, to_int8_form
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
def test_native_parse_equals_torch_in_the_kernel_form(kernels, kind, reordered):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, COLS, seed=3)))
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)) if reordered else None
    want = parse_blocks(kind, raw)
    want = want.rows(order) if reordered else want
    out = empty_blocks(FORM_OF[kind], ROWS + 32, COLS)
    kernels.parse_gguf(kind, raw, out, 32, order)            # after a first part's rows
    assert_same_blocks(out.row_range(32, 32 + ROWS), want)


@pytest.mark.parametrize("kind", sorted(FORM_OF))
@pytest.mark.parametrize("reordered", [False, True])
def test_native_parse_equals_torch_in_the_int8_form(kernels, kind, reordered):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, COLS, seed=4)))
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2)) if reordered else None
    want = parse_blocks(kind, raw)
    want = to_int8_form(want.rows(order) if reordered else want)
    out = empty_int8_blocks(FORM_OF[kind], 16 + ROWS, COLS)
    kernels.parse_gguf(kind, raw, out, 16, order)
    assert_same_blocks(out.row_range(16, 16 + ROWS), want)


def test_int8_forms_refuse_rows_that_cut_a_group(kernels):  # noqa: F811
    raw = torch.from_numpy(random_blocks("Q8_0", ROWS, COLS, seed=5))
    with pytest.raises(ValueError, match="cannot parse Q8_0"):
        kernels.parse_gguf("Q8_0", raw, empty_int8_blocks("Q8_0", 64, COLS), 8, None)

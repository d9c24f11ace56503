"""The int8-activation forms that keep the fp16 scales of GGUF's one-scale types
(models/int8_blocks.py): I8_Q4_0 (Q4_0), I8_Q4_1 (Q4_1) and I8_Q8_0 (Q8_0, Q5_0) take
the file's bytes (Q5_0: a byte a code) instead of the wide forms' fp32 scales and
minima.

They hold gguf-py's weights bit for bit (fp16 zeros, negatives and subnormals
included); on the avx2 loop their products equal the wide forms' to the bit (the same
integers meet the same fp32 scales, widened in the kernel), and on every level they
are within fp32 rounding of the quantized reference. The default model (Q4_1 layers,
a Q8_0 table) loads into them and gives the wide forms' logits exactly."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.kernels.block_types import FORMS, INT8_FORM_OF
from engine.models import int8_blocks
from engine.models.block_formats import FORM_OF, parse_blocks
from engine.models.block_weights import BlockLinear
from engine.models.int8_blocks import empty_int8_blocks
from tests.engine.test_block_formats import kernels, random_blocks  # noqa: F401
from tests.engine.test_block_parse import with_odd_scales
from tests.engine.test_int8_activations import quantized_product
from tests.engine.test_super_blocks import parsed
from tests.helpers import cpu_isa, runnable_isa_levels

AT_WIDTH = {"Q4_0": "I8_Q4_0", "Q4_1": "I8_Q4_1", "Q8_0": "I8_Q8_0", "Q5_0": "I8_Q8_0"}
ROWS, COLS = 48, 512


@pytest.mark.parametrize("kind", sorted(AT_WIDTH))
@pytest.mark.parametrize("reordered", [False, True])
def test_they_hold_gguf_pys_weights(kernels, kind, reordered):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, COLS, seed=5)))
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(3)) if reordered else None
    blocks = parsed(kernels, kind, AT_WIDTH[kind], raw, ahead=16, order=order)
    assert blocks.kind == AT_WIDTH[kind] and blocks.shape == (ROWS, COLS)
    assert blocks.scales.dtype == torch.float16
    assert (blocks.minima is None) == (kind != "Q4_1")
    want = parse_blocks(kind, raw).dequantize()
    want = want[order] if reordered else want
    assert torch.equal(blocks.dequantize(), want)
    index = torch.tensor([47, 0, 16, 17, 0])
    assert torch.equal(blocks.dequantize_rows(index), want[index])


@pytest.mark.parametrize("kind", sorted(AT_WIDTH))
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_products_equal_the_wide_forms(kernels, kind, rows):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, 1024, seed=rows)))
    blocks = parsed(kernels, kind, AT_WIDTH[kind], raw)
    wide = parsed(kernels, kind, INT8_FORM_OF[FORM_OF[kind]], raw)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(9))
    x[0, :32] = 0.0                                         # a block of zeros: scale 0
    got = kernels.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima)
    want = kernels.gemm(wide.kind, x, wide.codes, wide.scales, wide.minima)
    if kernels.int8_path in int8_blocks.AT_WIDTH_LOOPS:
        assert torch.equal(got, want)
    reference, size = quantized_product(x, blocks.dequantize())
    assert ((got.double() - reference).abs() / size).max() < 1e-5


@pytest.mark.parametrize("level", runnable_isa_levels())
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_every_level_multiplies_them(kernels, level, kind):  # noqa: F811
    """Levels without their tile take them one column at a time (the portable loop;
    the generic level widens fp16 without F16C, from the bits)."""
    from engine.kernels import load_native_kernels

    with cpu_isa(level):
        built = load_native_kernels()
    raw = with_odd_scales(kind, random_blocks(kind, 48, 1024, seed=13))   # subnormals too
    codes_at = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
    raw.reshape(48, 32, -1)[:, 0, codes_at:] = 0xFF                # the largest codes
    raw.reshape(48, 32, -1)[:, 1, codes_at:] = 0x80 if kind == "Q8_0" else 0
    raw = torch.from_numpy(raw)
    blocks = parsed(kernels, kind, AT_WIDTH[kind], raw)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(4))
    x[1, :64] = -x[1, :64].abs()
    got = built.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima)
    reference, size = quantized_product(x, blocks.dequantize())
    assert ((got.double() - reference).abs() / size).max() < 1e-5


@pytest.mark.parametrize("kind", sorted(AT_WIDTH))
def test_they_take_the_bytes_the_type_table_gives(kernels, kind):  # noqa: F811
    raw = torch.from_numpy(random_blocks(kind, 32, 1024, seed=1))
    blocks = parsed(kernels, kind, AT_WIDTH[kind], raw)
    held = sum(t.numel() * t.element_size() for t in (blocks.codes, blocks.scales, blocks.minima)
               if t is not None)
    assert held == 32 * 1024 // 256 * FORMS[AT_WIDTH[kind]].bytes_per_256
    if kind != "Q5_0":                                      # Q5_0's codes take a byte each
        assert held == raw.numel()                          # the file's bytes exactly


def test_a_form_takes_only_its_own_types(kernels):  # noqa: F811
    raw = torch.from_numpy(random_blocks("Q5_1", 16, 256, seed=1))
    with pytest.raises(ValueError, match="cannot parse 16 Q5_1 rows"):
        kernels.parse_gguf("Q5_1", raw, empty_int8_blocks("I8_Q8_0", 16, 256), 0, None)
    raw = torch.from_numpy(random_blocks("Q4_0", 16, 256, seed=1))
    with pytest.raises(ValueError, match="cannot parse 16 Q4_0 rows"):
        kernels.parse_gguf("Q4_0", raw, empty_int8_blocks("I8_Q4_1", 16, 256), 0, None)


def test_the_default_model_answers_as_the_wide_forms(kernels):  # noqa: F811
    """SmolLM2-135M Q4_1 (a Q8_0 table, tied to the head) in int8-activations: the
    layers and the table at the file's width, logits equal to the wide forms'."""
    if kernels.int8_path not in int8_blocks.AT_WIDTH_LOOPS:
        pytest.skip(f"the {kernels.int8_path} loop reads the wide forms")
    at_width = load_model("smollm2-135m-instruct", dtype="int8-activations", progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int8_blocks, "AT_WIDTH_LOOPS", ())
        wide = load_model("smollm2-135m-instruct", dtype="int8-activations", progress=False)
    kinds = {part.kind for m in at_width.module.modules() if isinstance(m, BlockLinear)
             for part in m.parts}
    assert kinds == {"I8_Q4_1", "I8_Q8_0"}
    ids = [1, 9690, 28, 18057, 30, 17, 4826, 6128, 25, 2]
    assert torch.equal(at_width.prompt_logits(ids), wide.prompt_logits(ids))


def test_a_form_with_minima_refuses_to_run_without_them(kernels):  # noqa: F811
    raw = torch.from_numpy(random_blocks("Q4_1", ROWS, 256, seed=2))
    blocks = parsed(kernels, "Q4_1", "I8_Q4_1", raw)
    with pytest.raises(RuntimeError, match="kernel failed"):
        kernels.gemm(blocks.kind, torch.randn(2, 256), blocks.codes, blocks.scales, None)

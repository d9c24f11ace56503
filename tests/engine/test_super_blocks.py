"""The super-block int8-activation forms (models/int8_blocks.py's SuperBlocks):
Q4_K and Q6_K read at their file's width (integer sub-scales under fp32 super-block
scales) instead of the wide forms' fp32 scales per block.

They hold gguf-py's weights bit for bit; on the avx2 loop I8_Q4K's products are the
wide form's to the bit (the same integers meet the same fp32 scales, formed in the
kernel) and I8_Q6K's within fp32 rounding of them (its sub-scales are applied in the
integers); on every level they are within fp32 rounding of the quantized reference.
A real Q4_K_M file loads into them and answers as the wide forms do, and they take
the bytes the type table says (what a token reads)."""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.kernels.block_types import FORMS, GGUF_TYPES, INT8_FORM_OF
from engine.models import int8_blocks
from engine.models.block_formats import BYTES_PER_BLOCK, FORM_OF, parse_blocks
from engine.models.block_weights import BlockLinear
from engine.models.int8_blocks import SuperBlocks, empty_int8_blocks, int8_form_for
from tests.engine.test_block_formats import kernels, random_blocks  # noqa: F401
from tests.engine.test_block_parse import with_odd_scales
from tests.engine.test_int8_activations import quantized_product
from tests.helpers import cpu_isa, runnable_isa_levels

SUPER = {"Q4_K": "I8_Q4K", "Q6_K": "I8_Q6K"}
ROWS, COLS = 48, 512


def parsed(kernels, kind: str, form: str, raw: torch.Tensor, ahead: int = 0,  # noqa: F811
           order: torch.Tensor | None = None):
    rows = raw.shape[0] if order is None else order.shape[0]
    weights = {t.name: t.weights for t in GGUF_TYPES}[kind]        # per block
    out = empty_int8_blocks(form, ahead + rows, raw.shape[1] // BYTES_PER_BLOCK[kind] * weights)
    kernels.parse_gguf(kind, raw, out, ahead, order)
    return out.row_range(ahead, ahead + rows)


@pytest.mark.parametrize("kind", sorted(SUPER))
@pytest.mark.parametrize("reordered", [False, True])
def test_super_blocks_hold_gguf_pys_weights(kernels, kind, reordered):  # noqa: F811
    raw = torch.from_numpy(with_odd_scales(kind, random_blocks(kind, ROWS, COLS, seed=4)))
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2)) if reordered else None
    blocks = parsed(kernels, kind, SUPER[kind], raw, ahead=16, order=order)
    assert isinstance(blocks, SuperBlocks) and blocks.shape == (ROWS, COLS)
    want = parse_blocks(kind, raw).dequantize()
    want = want[order] if reordered else want
    assert torch.equal(blocks.dequantize(), want)
    index = torch.tensor([47, 0, 16, 17, 0])
    assert torch.equal(blocks.dequantize_rows(index), want[index])


@pytest.mark.parametrize("kind", sorted(SUPER))
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_products_equal_the_wide_forms(kernels, kind, rows):  # noqa: F811
    """On a build with the super-block tile I8_Q4K's integers meet the same fp32
    scales as I8_Q4's (equal to the bit); I8_Q6K's and the portable loop's sums are
    within fp32 rounding."""
    raw = torch.from_numpy(random_blocks(kind, 64, 1024, seed=rows))
    blocks = parsed(kernels, kind, SUPER[kind], raw)
    wide = parsed(kernels, kind, INT8_FORM_OF[FORM_OF[kind]], raw)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(7))
    x[0, :32] = 0.0                                         # a block of zeros: scale 0
    got = kernels.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima)
    want = kernels.gemm(wide.kind, x, wide.codes, wide.scales, wide.minima)
    reference, size = quantized_product(x, blocks.dequantize())
    if kernels.int8_path in int8_blocks.AT_WIDTH_LOOPS and kind == "Q4_K":
        assert torch.equal(got, want)
    assert ((got.double() - reference).abs() / size).max() < 1e-5
    assert ((got.double() - want.double()).abs() / size).max() < 1e-5


@pytest.mark.parametrize("level", runnable_isa_levels())
@pytest.mark.parametrize("kind", sorted(SUPER))
def test_every_level_multiplies_the_super_blocks(kernels, level, kind):  # noqa: F811
    from engine.kernels import load_native_kernels

    with cpu_isa(level):
        built = load_native_kernels()
    raw = random_blocks(kind, 48, 1024, seed=11)
    codes_at = 16 if kind == "Q4_K" else 0
    raw.reshape(48, 4, -1)[:, 0, codes_at:codes_at + 128] = 0xFF   # the largest codes
    raw.reshape(48, 4, -1)[:, 1, codes_at:codes_at + 128] = 0
    raw = torch.from_numpy(raw)
    blocks = parsed(kernels, kind, SUPER[kind], raw)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(2))
    x[1, :128] = -x[1, :128].abs()
    got = built.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima)
    reference, size = quantized_product(x, blocks.dequantize())
    assert ((got.double() - reference).abs() / size).max() < 1e-5


@pytest.mark.parametrize("kind", sorted(SUPER))
def test_they_take_the_bytes_the_type_table_gives(kernels, kind):  # noqa: F811
    raw = torch.from_numpy(random_blocks(kind, 32, 1024, seed=1))
    for form in (SUPER[kind], INT8_FORM_OF[FORM_OF[kind]]):
        blocks = parsed(kernels, kind, form, raw)
        held = sum(t.numel() * t.element_size() for t in (blocks.codes, blocks.scales, blocks.minima))
        assert held == 32 * 1024 // 256 * FORMS[form].bytes_per_256
    file_bytes = raw.numel()
    assert FORMS[SUPER[kind]].bytes_per_256 * 32 * 4 < 1.06 * file_bytes   # near the file


def test_the_form_follows_the_builds_int8_loop():
    assert int8_form_for("Q4_K", "avx2") == "I8_Q4K"
    assert int8_form_for("Q6_K", "avx2") == "I8_Q6K"
    assert int8_form_for("Q4_0", "avx2") == "I8_Q4_0"
    assert int8_form_for("Q5_1", "avx2") == "I8_U8"              # no form at its width
    assert int8_form_for("Q4_0", "avx512_vnni") == "I8_Q4"
    assert int8_form_for("Q4_K", "avx512_vnni") == "I8_Q4"       # no tile there yet
    assert int8_form_for("Q6_K", "dotprod") == "I8_U8_16"


def test_a_super_block_form_takes_only_its_own_type(kernels):  # noqa: F811
    raw = torch.from_numpy(random_blocks("Q6_K", 16, 256, seed=1))
    with pytest.raises(ValueError, match="cannot parse 16 Q6_K rows"):
        kernels.parse_gguf("Q6_K", raw, empty_int8_blocks("I8_Q4K", 16, 256), 0, None)


@pytest.fixture(scope="module")
def gemma_forms(kernels):  # noqa: F811
    """Gemma 3 270M Q4_K_M (Q4_K o projections, Q4_K and Q6_K down projections) in
    int8-activations, read into the super-block forms and into the wide ones."""
    from engine.loading.model_files import resolve_embedded

    if kernels.int8_path not in int8_blocks.AT_WIDTH_LOOPS:
        pytest.skip(f"the {kernels.int8_path} loop reads the wide forms")
    path = str(resolve_embedded("gemma3-270m"))
    at_width = load_model(path, dtype="int8-activations", progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int8_blocks, "AT_WIDTH_LOOPS", ())
        wide = load_model(path, dtype="int8-activations", progress=False)
    return at_width, wide


def test_a_q4_k_m_file_loads_at_its_width_and_answers_as_the_wide_forms(gemma_forms):
    at_width, wide = gemma_forms
    kinds = {part.kind for m in at_width.module.modules() if isinstance(m, BlockLinear)
             for part in m.parts}
    assert {"I8_Q4K", "I8_Q6K"} <= kinds
    assert not {"I8_Q4K", "I8_Q6K"} & {part.kind for m in wide.module.modules()
                                       if isinstance(m, BlockLinear) for part in m.parts}
    ids = at_width.tokenizer.encode("The capital of France is Paris, and the capital of")
    got, want = at_width.prompt_logits(ids), wide.prompt_logits(ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # I8_Q6K's rounding differs from I8_U8_16's by ~1e-7 of a product, and a code of
    # the next layer's quantized activations may then round the other way: the two
    # differ as much as int8 activations differ from float32 on this prompt (max KL
    # per position 0.006 for both), far less than the int8 tests' bound (0.05)
    logprobs, at_width_logprobs = want.log_softmax(-1), got.log_softmax(-1)
    divergence = (logprobs.exp() * (logprobs - at_width_logprobs)).sum(-1)
    assert divergence.max() < 0.02

"""The one table of block types (engine/kernels/block_types.py): the C header written
from it is current, and its GGUF facts are gguf-py's."""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.kernels.block_types import GGUF_TYPES, HEADER, KERNEL_FORMS, c_header


def test_the_c_header_is_written_from_the_table():
    assert HEADER.read_text() == c_header(), (
        "engine/kernels/block_types.h is stale: run python -m engine.kernels.block_types")


def test_each_gguf_type_has_gguf_pys_id_and_sizes():
    for block_type in GGUF_TYPES:
        ggml = GGMLQuantizationType[block_type.name]
        assert ggml.value == block_type.ggml_type
        assert GGML_QUANT_SIZES[ggml] == (block_type.weights, block_type.bytes)


def test_codes_are_unique_and_every_form_is_known():
    forms = {form.name for form in KERNEL_FORMS}
    assert len({t.code for t in GGUF_TYPES}) == len(GGUF_TYPES)
    assert len({form.code for form in KERNEL_FORMS}) == len(KERNEL_FORMS)
    assert {t.form for t in GGUF_TYPES} <= forms
    assert {form.int8_form for form in KERNEL_FORMS if form.int8_form} <= forms


def test_every_gguf_type_parses_and_every_form_is_sized_by_its_traits():
    """torch's parser of every type gives its table form, and a form's empty blocks
    (as the native parser fills them) hold what a token reads of it: bytes_per_256."""
    import torch

    from engine.models.block_formats import TORCH_PARSERS, empty_blocks, parse_blocks
    from engine.models.int8_blocks import empty_int8_blocks

    assert set(TORCH_PARSERS) == {t.name for t in GGUF_TYPES}
    for block_type in GGUF_TYPES:
        row_bytes = 256 // block_type.weights * block_type.bytes
        raw = torch.randint(0, 256, (16, row_bytes), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(block_type.code))
        assert parse_blocks(block_type.name, raw).kind == block_type.form
    for form in KERNEL_FORMS:
        make = empty_blocks if form.int8_form else empty_int8_blocks
        blocks = make(form.name, 16, 512)
        held = sum(t.numel() * t.element_size()
                   for t in (blocks.codes, blocks.scales, blocks.minima) if t is not None)
        assert held == 16 * 2 * form.bytes_per_256, form.name
        assert blocks.codes.shape[1] * 8 == 512 * form.code_bits
        assert blocks.codes.dtype in (torch.uint8, torch.int8)

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

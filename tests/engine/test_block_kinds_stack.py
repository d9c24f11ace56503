"""Layers on any mix of block kinds run the fast decode path and its whole-stack call
(models/fast_decode.py, decode_layer.c), bit for bit as the layer loop does, and
decode like the dense path.

The model is a GGUF copy of the default one with every kernel form in it
(tests/gguf_copies.py's mixed_encoding): a fused qkv of two kinds (Q4_1 q and k,
Q8_0 v, as a Q4_K_M file's Q4_K q, k and Q6_K v), a Q5_1 o projection, gate/up in
Q8_0 and Q4_1 in turn, down in Q5_K and Q8_0 in turn.
"""

from __future__ import annotations

import pytest

from engine import load_model
from engine.models.block_weights import BlockLinear
from engine.models.fast_decode import FastDecodeLayer, FastDecodeStack
from tests.engine.test_packed_stack import assert_fast_stack_serves_its_rows
from tests.gguf_copies import mixed_encoding, write_requantized
from tests.helpers import assert_blocks_decode_like_dense, layer_executors


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    from engine.loading.model_files import resolve_embedded

    path = tmp_path_factory.mktemp("mixed") / "smollm2-mixed.gguf"
    written = write_requantized(resolve_embedded("smollm2-135m-instruct"), path, mixed_encoding)
    assert {kind: written[kind] for kind in ("Q4_1", "Q5_1", "Q5_K")} == {
        "Q4_1": 30 * 2 + 15 * 2, "Q5_1": 30, "Q5_K": 15}
    assert written["Q8_0"] >= 30 + 15 * 2 + 15          # and the file's own embeddings
    return path


@pytest.fixture(scope="module")
def mixed(mixed_path):
    return load_model(str(mixed_path), progress=False)


def test_every_layer_of_mixed_kinds_is_on_the_stack(mixed):
    layers = mixed.module.layers
    assert [type(s) for s in mixed.module.executors.stacks] == [FastDecodeStack]
    assert all(isinstance(e, FastDecodeLayer)
               for e in layer_executors(mixed.module, FastDecodeLayer))
    qkv = layers[0].self_attn.qkv_proj
    assert qkv.kind == "mixed" and [p.kind for p in qkv.parts] == ["Q4_1", "Q8_0"]
    assert {layer.self_attn.o_proj.kind for layer in layers} == {"Q5_1"}
    assert [(layers[i].mlp.gate_up_proj.kind, layers[i].mlp.down_proj.kind)
            for i in (0, 1)] == [("Q8_0", "Q5_1"), ("Q4_1", "Q8_0")]
    assert sum(isinstance(m, BlockLinear) for m in layers.modules()) == 4 * 30


def test_the_stack_of_mixed_kinds_is_bit_identical_to_the_layers(mixed):
    assert_fast_stack_serves_its_rows(mixed)


@pytest.mark.slow
def test_a_model_of_mixed_kinds_decodes_like_the_dense_path(mixed, mixed_path):
    dense = load_model(str(mixed_path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(mixed, dense, max_new_tokens=16)

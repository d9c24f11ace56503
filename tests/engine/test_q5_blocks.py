"""A model whose GGUF file holds Q5_1 and Q5_K blocks (as Q5_K_M and Q5_1 files do)
decodes from those blocks with the dense path's greedy tokens.

No such file ships with a package, so the test writes one: the default model's file
with its attention and MLP weights re-quantized, Q5_1 by gguf-py and Q5_K by
tests/gguf_copies.py's `quantize_q5_k` (gguf-py only dequantizes the K types). Rows
of 576 weights are not whole 256-weight super-blocks, so, as llama.cpp does for such
rows, only the down projections (rows of 1,536) take Q5_K. Its layers decode on the
whole-stack native call, as Q4_1 ones do.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import load_model
from engine.models.block_weights import BlockLinear
from engine.models.fast_decode import FastDecodeStack
from tests.gguf_copies import q5_encoding, quantize_q5_k, write_requantized
from tests.helpers import assert_blocks_decode_like_dense


def test_the_q5_k_encoding_reads_back_through_gguf_py():
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(0).normal(0, 0.05, (6, 512)).astype(np.float32)
    raw = quantize_q5_k(weights)
    assert raw.shape == (6, 2 * 176)
    back = quants.dequantize(raw, GGMLQuantizationType.Q5_K).reshape(6, 512)
    step = (weights.max() - weights.min()) / 31
    assert np.abs(back - weights).max() <= step        # a 5-bit code's rounding, and more


@pytest.mark.slow
def test_a_q5_model_decodes_from_its_own_blocks(tmp_path):
    from engine.loading.model_files import resolve_embedded

    path = tmp_path / "smollm2-q5.gguf"
    written = write_requantized(resolve_embedded("smollm2-135m-instruct"), path, q5_encoding)
    assert written["Q5_K"] == 30 and written["Q5_1"] == 30 * 6
    blocked = load_model(str(path), progress=False)
    projections = [m for m in blocked.module.layers.modules() if isinstance(m, BlockLinear)]
    assert len(projections) == 4 * 30 and {m.kind for m in projections} == {"Q5_1"}
    assert [type(s) for s in blocked.module.executors.stacks] == [FastDecodeStack]
    dense = load_model(str(path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(blocked, dense, max_new_tokens=16)

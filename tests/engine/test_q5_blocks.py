"""A model whose GGUF file holds Q5_1 and Q5_K blocks (as Q5_K_M and Q5_1 files do)
decodes from those blocks with the dense path's greedy tokens.

No such file ships with a package, so the test writes one: the default model's file
with its attention and MLP weights re-quantized, Q5_1 by gguf-py and Q5_K by
`quantize_q5_k` below (gguf-py only dequantizes the K types). Rows of 576 weights are
not whole 256-weight super-blocks, so, as llama.cpp does for such rows, only the down
projections (rows of 1,536) take Q5_K.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from engine import load_model
from engine.models.block_weights import BlockLinear
from tests.helpers import assert_blocks_decode_like_dense


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """fp32 [rows, K] (K a multiple of 256) -> Q5_K bytes [rows, K / 256 * 176]: per
    32 weights a 6-bit scale and minimum under the super-block's fp16 d and dmin,
    codes 0..31 (round to nearest; not llama.cpp's search, just a valid encoding)."""
    rows = weights.shape[0]
    w = weights.reshape(rows, -1, 8, 32).astype(np.float32)          # [R, S, sub, 32]
    low, high = np.minimum(w.min(-1), 0.0), w.max(-1)
    step, floor = np.maximum(high - low, 1e-8) / 31, -low               # [R, S, 8]
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = np.maximum(floor.max(-1) / 63, 1e-8).astype(np.float16)
    sc = np.clip(np.rint(step / d[..., None].astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(floor / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    scale = d[..., None].astype(np.float32) * sc
    minimum = dmin[..., None].astype(np.float32) * mn
    q = np.clip(np.rint((w + minimum[..., None]) / scale[..., None]), 0, 31).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                             mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
    pairs = q.reshape(rows, -1, 4, 2, 32)                             # chunk c, half h
    codes = (pairs[:, :, :, 0] & 15) | ((pairs[:, :, :, 1] & 15) << 4)  # [R, S, 4, 32]
    bits = (pairs >> 4) << np.arange(8, dtype=np.uint8).reshape(4, 2, 1)   # bit 2c + h
    fifth = np.bitwise_or.reduce(bits.reshape(rows, -1, 8, 32), axis=2)  # [R, S, 32]
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                             packed, fifth, codes.reshape(rows, -1, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def test_the_q5_k_encoding_reads_back_through_gguf_py():
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(0).normal(0, 0.05, (6, 512)).astype(np.float32)
    raw = quantize_q5_k(weights)
    assert raw.shape == (6, 2 * 176)
    back = quants.dequantize(raw, GGMLQuantizationType.Q5_K).reshape(6, 512)
    step = (weights.max() - weights.min()) / 31
    assert np.abs(back - weights).max() <= step        # a 5-bit code's rounding, and more


def write_q5_model(source, target) -> collections.Counter:
    """The GGUF file at `source` copied to `target` with attention and MLP weights in
    Q5_1 (Q5_K for rows of a multiple of 256); returns the types written."""
    import gguf
    from gguf import GGMLQuantizationType as Type, quants

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    tensors, written = [], collections.Counter()
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if any(part in tensor.name for part in ("attn_", "ffn_")) and data.ndim == 2 \
                and kind not in (Type.F32, Type.F16):
            weights = quants.dequantize(data, kind)
            if weights.shape[1] % 256 == 0:
                data, kind = quantize_q5_k(weights), Type.Q5_K
            else:
                data, kind = quants.quantize(weights, Type.Q5_1), Type.Q5_1
        written[kind.name] += 1
        tensors.append(data)
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return written


@pytest.mark.slow
def test_a_q5_model_decodes_from_its_own_blocks(tmp_path):
    from engine.loading import resolve_embedded

    path = tmp_path / "smollm2-q5.gguf"
    written = write_q5_model(resolve_embedded("smollm2-135m-instruct"), path)
    assert written["Q5_K"] == 30 and written["Q5_1"] == 30 * 6
    blocked = load_model(str(path), progress=False)
    projections = [m for m in blocked.module.layers.modules() if isinstance(m, BlockLinear)]
    assert len(projections) == 4 * 30 and {m.kind for m in projections} == {"Q5_1"}
    dense = load_model(str(path), progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(blocked, dense, max_new_tokens=16)

"""GGUF's Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (what Q4_K_M and Q5_K_M files
hold) read into the block kernels' forms: their weights equal gguf-py's dequantized
values bit for bit, every form's kernel equals the dense matmul, fused projections
whose parts differ in form write their own columns, and the real Gemma 3 270M Q4_K_M
file decodes from its own blocks with the dense path's greedy tokens."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import load_model
from engine.kernels import load_native_kernels
from engine.models.block_formats import BYTES_PER_BLOCK, FORM_OF, parse_blocks
from engine.models.block_weights import BlockLinear
from tests.helpers import assert_blocks_decode_like_dense

FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
"""Byte offsets of each type's fp16 scales within a block (the rest are codes)."""


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """GGUF rows [rows, bytes] of random codes and sub-scales with realistic fp16
    scales (negative minima for Q4_1, as its minima usually are)."""
    rng = np.random.default_rng(seed)
    per_block = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, (rows, cols // per_block, BYTES_PER_BLOCK[kind]), dtype=np.uint8)
    for offset in FP16_FIELDS[kind]:
        sign = -1.0 if (kind, offset) in (("Q4_1", 2), ("Q5_1", 2)) else 1.0
        values = sign * (rng.random((rows, cols // per_block, 1)) * 0.02 + 1e-3)
        raw[..., offset:offset + 2] = values.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


def within_rounding(got, want, x, weight) -> bool:
    """Two fp32 sums of the same K terms in different orders: allow 1e-5 of the sum
    of the terms' magnitudes (a wrong weight or a misplaced code is far larger)."""
    return bool(((got - want).abs() <= 1e-5 * (x.abs() @ weight.abs().T) + 1e-7).all())


@pytest.mark.parametrize("kind", sorted(FORM_OF))
def test_every_type_dequantizes_as_gguf_py_does(kind):
    from gguf import GGMLQuantizationType, quants

    raw = random_blocks(kind, 6, 512, seed=len(kind))
    blocks = parse_blocks(kind, torch.from_numpy(raw.copy()))
    want = quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(6, 512)
    assert blocks.kind == FORM_OF[kind]
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("kind", sorted(FORM_OF))
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_every_form_multiplies_like_the_dense_weight(kernels, kind, rows):
    blocks = parse_blocks(kind, torch.from_numpy(random_blocks(kind, 80, 512, seed=rows).copy()))
    weight = blocks.dequantize()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = kernels.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima)
    assert within_rounding(got, F.linear(x, weight), x, weight)
    wide = torch.full((rows, 120), 7.0)           # into columns 20..99 of a wider output
    kernels.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima, out=wide[:, 20:100])
    assert torch.equal(wide[:, 20:100], got)
    assert (wide[:, :20] == 7).all() and (wide[:, 100:] == 7).all()


@pytest.mark.parametrize("kind", sorted(FORM_OF))
@pytest.mark.parametrize("rows", [33, 64])
@pytest.mark.parametrize("k", [768, 2304])
def test_steps_of_many_rows_multiply_like_the_dense_weight(kernels, kind, rows, k):
    """Steps of 32 rows and more take panels on AVX2 builds (block_panels.c): 40
    columns are a chunk of two panels of 16 and a chunk of one panel of 8; 33 rows
    five tiles of 6 and one of 3; K = 2,304 two slices (2,048 and 256), the second
    added to the first's sums in y."""
    blocks = parse_blocks(kind, torch.from_numpy(random_blocks(kind, 40, k, seed=rows).copy()))
    weight = blocks.dequantize()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    wide = torch.full((rows, 50), 7.0)
    got = kernels.gemm(blocks.kind, x, blocks.codes, blocks.scales, blocks.minima,
                       out=wide[:, 5:45])
    assert within_rounding(got, F.linear(x, weight), x, weight)
    assert (wide[:, :5] == 7).all() and (wide[:, 45:] == 7).all()


@pytest.mark.parametrize("qk_kind", ["Q4_K", "Q5_K"])
def test_a_fused_projection_of_mixed_forms_writes_each_part_into_its_columns(kernels, qk_kind):
    """A Q4_K_M (Q5_K_M) qkv: q and k in Q4_K (Q5_K), v in Q6_K (the Q8_16 form)."""
    parts = [parse_blocks(kind, torch.from_numpy(random_blocks(kind, n, 256, seed=n).copy()))
             for kind, n in ((qk_kind, 48), (qk_kind, 16), ("Q6_K", 16))]
    weight = torch.cat([p.dequantize() for p in parts])
    layer = BlockLinear(weight, None, parts, kernels)
    assert layer.kind == "mixed" and [p.kind for p in layer.parts] == [FORM_OF[qk_kind], "Q8_16"]
    assert layer.parts[0].codes.shape[0] == 64               # q and k joined
    for rows in (1, 3, layer.max_rows + 1):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got = layer(x)
        assert got.shape == (rows, 80) and within_rounding(got, F.linear(x, weight), x, weight)


@pytest.mark.slow
def test_gemma3_q4_k_m_decodes_from_its_own_blocks():
    """Gemma 3 270M's file mixes Q5_0, Q8_0, Q4_K and Q6_K: every projection and the LM
    head run on blocks, with the dense fp32 path's greedy tokens and logprobs."""
    blocked = load_model("gemma3-270m", progress=False)
    modules = [m for m in blocked.module.modules() if isinstance(m, BlockLinear)]
    kinds = collections.Counter(m.kind for m in modules)
    assert len(modules) == 4 * len(blocked.module.layers) + 1
    assert set(kinds) == {"Q4_1", "Q8_0", "Q8_16"}
    dense = load_model("gemma3-270m", progress=False, block_kernels=False)
    assert_blocks_decode_like_dense(blocked, dense, max_new_tokens=24)


@pytest.mark.parametrize("kind", sorted(FORM_OF))
def test_parts_parsed_into_one_buffer_equal_their_own_parse_and_join_without_a_copy(kind):
    """A fused projection's parts (q, k, v rows) parsed into one buffer, straight from
    read-only bytes, hold what parse_blocks gives each (in a row order, where one is
    asked for), and concat joins them as a view of that buffer."""
    from engine.models.block_formats import concat, empty_blocks, parse_blocks_into

    sizes, cols = (8, 4, 4), 512
    raws = [random_blocks(kind, rows, cols, seed=i) for i, rows in enumerate(sizes)]
    for raw in raws:
        raw.flags.writeable = False                   # as the mapped file is
    order = torch.randperm(sizes[1], generator=torch.Generator().manual_seed(0))
    out = empty_blocks(FORM_OF[kind], sum(sizes), cols)
    parts, start = [], 0
    for i, raw in enumerate(raws):
        with warnings.catch_warnings():          # torch warns that the view is read-only
            warnings.simplefilter("ignore", UserWarning)
            view = torch.from_numpy(raw)
        parse_blocks_into(kind, view, out, start, order if i == 1 else None)
        parts.append(out.row_range(start, start + raw.shape[0]))
        start += raw.shape[0]
    for i, (raw, part) in enumerate(zip(raws, parts)):
        want = parse_blocks(kind, torch.from_numpy(raw.copy()))
        want = want.rows(order) if i == 1 else want
        for got_field, want_field in ((part.codes, want.codes), (part.scales, want.scales),
                                      (part.minima, want.minima)):
            assert (got_field is None) == (want_field is None)
            assert got_field is None or torch.equal(got_field, want_field)
    joined = concat(parts)
    assert joined.codes.data_ptr() == out.codes.data_ptr()        # a view: nothing copied
    assert torch.equal(joined.dequantize(), out.dequantize())
    copied = concat([parts[1], parts[0]])                          # out of order: a copy
    assert copied.codes.data_ptr() != out.codes.data_ptr()
    assert torch.equal(copied.dequantize(), torch.cat([parts[1].dequantize(),
                                                       parts[0].dequantize()]))


"""Decode from GGUF weight blocks: the native kernel equals an fp32 matmul with the
dequantized weights, the real default model's projections are all found in its GGUF
file bit for bit, and its greedy answers (through the fused MLP and the fast decode
layers) equal the dense fp32 path's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.kernels import build as kernel_build
from engine.kernels import load_native_kernels
from engine.kernels.native import FUSED_ACTIVATIONS
from engine.models.block_weights import (BlockLinear, Blocks, FusedBlockMLP,
                                         concat, parse_blocks)
from engine.models.fast_decode import FastDecodeLayer
from engine.models.layers import GatedMLP
from tests.helpers import block_kernel_rows, layer_executors

KERNEL_ROWS = block_kernel_rows()


def random_gguf_bytes(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Raw GGUF rows of random blocks with realistic fp16 scales (and minima)."""
    rng = np.random.default_rng(seed)
    blocks = cols // 32
    scales = (rng.random((rows, blocks, 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        codes = rng.integers(-128, 128, (rows, blocks, 32), dtype=np.int8).view(np.uint8)
        raw = np.concatenate([scales, codes], axis=-1)
    else:
        minima = (-rng.random((rows, blocks, 1)) * 0.1).astype(np.float16).view(np.uint8)
        codes = rng.integers(0, 256, (rows, blocks, 16), dtype=np.uint8)
        raw = np.concatenate([scales, minima, codes], axis=-1)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def assert_within_rounding(got, want, x, weight):
    """Two fp32 sums of the same K terms in different orders differ by at most about
    K * 2^-24 (3.4e-5 for K = 576) of the sum of the terms' magnitudes; allow 1e-5
    of it (typical differences are far smaller, a wrong weight far larger)."""
    magnitude = x.abs() @ weight.abs().T
    assert ((got - want).abs() <= 1e-5 * magnitude + 1e-7).all()


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


def test_parsed_blocks_dequantize_as_the_gguf_formula():
    raw = random_gguf_bytes("Q4_1", 2, 64, seed=0)
    blocks = parse_blocks("Q4_1", raw)
    first = raw[0, :20].numpy()
    d, m = (float(v) for v in first[:4].view(np.float16))
    want = [d * (b & 0x0F) + m for b in first[4:20]] + [d * (b >> 4) + m for b in first[4:20]]
    assert blocks.dequantize()[0, :32].tolist() == pytest.approx(want, rel=1e-6)
    assert blocks.codes.shape == (2, 32) and blocks.scales.shape == (2, 2)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 12, 16, 17, 40, KERNEL_ROWS, KERNEL_ROWS + 1])
def test_block_linear_equals_the_dense_matmul(kernels, kind, rows):
    blocks = parse_blocks(kind, random_gguf_bytes(kind, 96, 576, seed=rows))
    weight = blocks.dequantize()
    layer = BlockLinear(weight, None, blocks, kernels)
    x = torch.randn(rows, 576)
    got, want = layer(x), F.linear(x, weight)
    assert_within_rounding(got, want, x, weight)
    assert layer.max_rows == KERNEL_ROWS
    if rows > KERNEL_ROWS:                   # large steps run torch's dense matmul
        assert torch.equal(got, want)


def test_fused_blocks_keep_their_row_order(kernels):
    parts = [parse_blocks("Q4_1", random_gguf_bytes("Q4_1", n, 64, seed=n)) for n in (32, 16)]
    fused = concat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    layer = BlockLinear(fused.dequantize(), None, fused, kernels)
    x = torch.randn(2, 64)
    assert_within_rounding(layer(x), x @ fused.dequantize().T, x, fused.dequantize())


def block_linear(kernels, kinds: list[str], rows: int, cols: int, seed: int) -> BlockLinear:
    """A BlockLinear [rows, cols] of random blocks, its rows split evenly between
    `kinds` (two kinds: a "mixed" weight, as a Q4_K_M file's fused qkv)."""
    parts = [parse_blocks(kind, random_gguf_bytes(kind, rows // len(kinds), cols, seed + i))
             for i, kind in enumerate(kinds)]
    weight = torch.cat([part.dequantize() for part in parts])
    return BlockLinear(weight, None, parts if len(parts) > 1 else parts[0], kernels)


@pytest.mark.parametrize("kinds", [(["Q4_1"], ["Q4_1"]), (["Q8_0"], ["Q4_1"]),
                                   (["Q4_1", "Q8_0"], ["Q8_0"])])
@pytest.mark.parametrize("rows", [1, 5, 13, KERNEL_ROWS, KERNEL_ROWS + 1])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fused_mlp_equals_the_two_projections(kernels, rows, kinds, act):
    """down(act(gate(x)) * up(x)) in one native call equals the module's own path
    (13 rows: a full tile of 8 and a partial one), for Q4_1 weights (SiLU: one fused
    sweep) and for other kinds and mixed ones (gate and up products, then the
    activation; Gemma's GELU-tanh in C against torch's)."""
    hidden, inter = 64, 96
    gate_up = block_linear(kernels, kinds[0], 2 * inter, hidden, seed=1)
    down = block_linear(kernels, kinds[1], hidden, inter, seed=5)
    assert gate_up.kind == (kinds[0][0] if len(kinds[0]) == 1 else "mixed")
    assert FusedBlockMLP.applies(gate_up, down, act)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
    unfused = GatedMLP(gate_up, down, act)(x)
    fused = GatedMLP(gate_up, down, act, FusedBlockMLP(gate_up, down, kernels,
                                                       FUSED_ACTIVATIONS[act]))(x)
    if rows > KERNEL_ROWS:                       # not a step for the kernel: same path
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-5)


def test_kernels_can_be_turned_off_or_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "0")
    assert load_native_kernels(tmp_path) is None
    monkeypatch.delenv("KVSERVE_NATIVE_KERNELS")
    monkeypatch.setenv("CC", "false")            # a "compiler" that always fails
    monkeypatch.setattr(kernel_build.shutil, "which",
                        lambda name: "/bin/false" if name == "false" else None)
    assert load_native_kernels(tmp_path / "failing") is None


@pytest.mark.slow
def test_default_model_decodes_from_its_blocks_like_the_dense_path():
    fast = load_model("smollm2-135m-instruct", progress=False)
    dense = load_model("smollm2-135m-instruct", progress=False, block_kernels=False)
    layers = list(fast.module.layers)
    block_layers = [m for layer in layers for m in layer.modules() if isinstance(m, BlockLinear)]
    assert len(block_layers) == 4 * len(layers)          # qkv, o, gate_up, down everywhere
    assert {m.kind for m in block_layers} == {"Q4_1"}
    assert fast.module.lm_head.kind == "Q8_0"            # the tied embedding table
    assert all(isinstance(layer.mlp.fused, FusedBlockMLP) for layer in layers)
    assert all(isinstance(e, FastDecodeLayer)
               for e in layer_executors(fast.module, FastDecodeLayer))
    assert not any(isinstance(m, BlockLinear) for m in dense.module.modules())
    tokenizer = fast.tokenizer
    prompts = [tokenizer.encode(text) for text in (
        "The three primary colors are", "def add(a, b):", "Once upon a time")]
    config = GenerationConfig(max_new_tokens=32)
    with_logprobs = ContinuousBatchingConfig(return_logprobs=True)
    got = list(fast.generate_batch(prompts, config, with_logprobs).values())
    want = list(dense.generate_batch(prompts, config, with_logprobs).values())
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    for fast_output, dense_output in zip(got, want):      # the same numbers, to rounding
        assert fast_output.logprobs == pytest.approx(dense_output.logprobs, abs=2e-4)
    wide = [prompt + tokenizer.encode(f" {i}") for i in range(12) for prompt in prompts]
    assert len(wide) >= 32              # steps of 36 rows: AVX2 builds' panels serve them
    short = GenerationConfig(max_new_tokens=6)
    got = list(fast.generate_batch(wide, short, with_logprobs).values())
    want = list(dense.generate_batch(wide, short, with_logprobs).values())
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    for fast_output, dense_output in zip(got, want):
        assert fast_output.logprobs == pytest.approx(dense_output.logprobs, abs=2e-4)


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "skylake-avx512"])
def test_the_library_builds_for_cpus_without_this_ones_features(tmp_path, march):
    """Each kernel file keeps a fallback (or stubs the Python side never calls) for CPUs
    without AVX-512 or AVX512-BF16: the library must still build there, or a machine
    without them would lose every native kernel. Builds for older x86 targets here."""
    import platform
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if platform.machine() != "x86_64" or compiler is None:
        pytest.skip("x86-64 targets need an x86-64 compiler")
    built = subprocess.run([compiler, "-O1", f"-march={march}", *kernel_build.INCLUDE_FLAGS,
                            "-pthread", "-shared", "-fPIC",
                            "-Werror=implicit-function-declaration", "-o",
                            str(tmp_path / "kernels.so"), *map(str, kernel_build.SOURCES), "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_tensor_table_reader_finds_what_gguf_py_finds(alias):
    """read_block_tensors (the tensor table, metadata skipped unread) gives the block
    tensors of the embedded models (Q4_1 and Q8_0; Gemma 3's Q4_K_M file: Q5_0, Q8_0,
    Q4_K, Q6_K) with the names, shapes and bytes gguf-py's reader gives."""
    import gguf

    from engine.loading.model_files import resolve_embedded
    from engine.models.gguf_tensors import GGML_TYPES, read_block_tensors

    path = resolve_embedded(alias)
    names = {name for name, _, _ in GGML_TYPES.values()}
    ours = read_block_tensors(path)
    theirs = [t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name in names]
    assert [(t.name, t.kind) for t in ours] == [(t.name, t.tensor_type.name) for t in theirs]
    assert len(ours) > 100
    assert {t.kind for t in ours} == ({"Q4_1", "Q8_0"} if alias.startswith("smollm2")
                                      else {"Q5_0", "Q8_0", "Q4_K", "Q6_K"})
    for mine, reference in zip(ours, theirs):
        assert mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data), mine.name


def test_the_tensor_table_reader_refuses_what_it_cannot_read(tmp_path):
    import shutil

    from engine.loading.model_files import resolve_embedded
    from engine.models.gguf_tensors import read_block_tensors

    source = resolve_embedded("smollm2-135m-instruct")
    truncated = tmp_path / "truncated.gguf"
    with open(source, "rb") as file:
        truncated.write_bytes(file.read(4_000_000))         # metadata whole, tensors cut
    not_gguf = tmp_path / "other.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(64))
    big_endian = tmp_path / "big.gguf"
    shutil.copyfile(source, big_endian)
    with open(big_endian, "r+b") as file:
        file.seek(4)
        file.write((3).to_bytes(4, "big"))
    for path in (truncated, not_gguf, big_endian):
        with pytest.raises(ValueError):
            read_block_tensors(path)


def test_the_block_kernels_report_the_vectors_of_this_cpu(kernels):
    """block_gemm_lanes follows the ISA level the library was built for (isa.py), and
    the rows the block kernels take follow it."""
    from engine.models.block_weights import MAX_KERNEL_ROWS, PANEL_KERNEL_ROWS, kernel_rows

    want = {"avx512": 16, "avx_vnni": 8, "avx2": 8, "neon": 4, "dotprod": 4}.get(kernels.isa, 1)
    assert kernels.block_lanes == want
    assert kernel_rows(kernels) == (PANEL_KERNEL_ROWS if want in (8, 16) else MAX_KERNEL_ROWS)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q8_16"])
@pytest.mark.parametrize("out_features,in_features", [(50, 64), (17, 1536), (33, 4096)])
def test_panel_steps_equal_the_dense_product(kernels, kind, out_features, in_features):
    """Steps of many rows run through panels (block_panels.c) on vector builds: every
    kind, widths that leave a partial panel (50 = 32 + 16 + 2 columns, 17, 33), K past
    one slice of panel (4,096 > PANEL_K) and tiles of uneven row counts, all within
    fp32 rounding of the dense product with the dequantized weights."""
    if kind == "Q4_1":
        blocks = parse_blocks(kind, random_gguf_bytes(kind, out_features, in_features, seed=3))
        codes, scales, minima, weight = (blocks.codes, blocks.scales, blocks.minima,
                                         blocks.dequantize())
    else:                                  # int8 codes with a scale per 32 (per 16) weights
        group = 16 if kind == "Q8_16" else 32
        codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
        scales = torch.rand(out_features, in_features // group) * 0.02 + 0.001
        minima, weight = None, codes.float() * scales.repeat_interleave(group, dim=1)
    for rows in (16, 17, 25, 40, 64):
        x = torch.randn(rows, in_features)
        got = kernels.gemm(kind, x, codes, scales, minima)
        assert_within_rounding(got, F.linear(x, weight), x, weight)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 8, 16, 40])
def test_the_kernels_multiply_the_loaders_weights_bit_for_bit(kernels, kind, rows):
    """Rows of x that are one-hot pick single weights out of the product, so each output
    is one weight times 1 (plus exact zeros): the row kernels and the panels must give
    the dequantized fp32 weights themselves, not a rounding of them."""
    blocks = parse_blocks(kind, random_gguf_bytes(kind, 70, 576, seed=rows))
    weight = blocks.dequantize()
    picked = (torch.arange(rows) * 37) % 576
    x = torch.zeros(rows, 576)
    x[torch.arange(rows), picked] = 1.0
    got = kernels.gemm(kind, x, blocks.codes, blocks.scales, blocks.minima)
    assert torch.equal(got, weight[:, picked].T)

"""dtype int8-activations: a GGUF's blocks repacked into column groups
(models/int8_blocks.py) and multiplied by activations quantized to int8 per 32 values
(kernels/block_int8.c).

The kernels are checked against a float64 reference that quantizes x the same way
(absmax / 127 per block, round half to even): the only difference left is fp32
rounding. A model on them is checked against the same model in float32 on the same
blocks (its logits within int8's error, its fast decode stack bit for bit as its
layer loop), and the mode's limits give clear errors.
"""

from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.kernels.build import default_kernels
from engine.models.block_formats import Blocks
from engine.models.block_weights import BlockLinear
from engine.models.int8_blocks import int8_form_for, to_int8_form
from tests.engine.test_block_kinds_stack import mixed_path  # noqa: F401 (fixture)
from tests.engine.test_packed_stack import assert_fast_stack_serves_its_rows
from tests.helpers import cpu_isa, runnable_isa_levels

FORMS = ("Q4_1", "Q8_0", "Q5_1", "Q8_16")

kernels = default_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="no C compiler: no native kernels")


def random_blocks(kind: str, n: int, k: int, seed: int) -> Blocks:
    generator = torch.Generator().manual_seed(seed)
    blocks = k // 32
    scales = torch.rand(n, 2 * blocks if kind == "Q8_16" else blocks, generator=generator) * 0.01
    minima = -torch.rand(n, blocks, generator=generator) * 0.05
    if kind == "Q4_1":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
        return Blocks(kind, codes, scales, minima)
    if kind == "Q5_1":
        return Blocks(kind, torch.randint(0, 32, (n, k), dtype=torch.int8, generator=generator),
                      scales, minima)
    low = -32 if kind == "Q8_16" else -128                  # Q8_16 holds Q6_K's q - 32
    return Blocks(kind, torch.randint(low, -low, (n, k), dtype=torch.int8, generator=generator),
                  scales, None)


def quantized_product(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized as the kernels quantize it, times weight^T, in float64; and the sum of
    the terms' sizes, the scale of fp32's rounding."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (blocks * inverse).round()
    x_hat = (codes.double() * (amax / 127.0).double()).view(rows, k)
    return x_hat @ weight.double().T, x_hat.abs() @ weight.double().abs().T


@pytest.mark.parametrize("kind", FORMS)
def test_repacked_blocks_hold_the_same_weights(kind):
    blocks = random_blocks(kind, 48, 256, seed=1)
    repacked = to_int8_form(blocks)
    assert repacked.codes.shape == blocks.codes.shape
    assert repacked.shape == blocks.shape
    assert torch.allclose(repacked.dequantize(), blocks.dequantize(), rtol=1e-6, atol=1e-7)
    index = torch.tensor([47, 0, 16, 17, 0])              # a tied table's lookups
    assert torch.equal(repacked.dequantize_rows(index), repacked.dequantize()[index])


@needs_kernels
@pytest.mark.parametrize("kind", FORMS)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 20, 64])
def test_int8_products_equal_the_quantized_reference(kind, rows):
    blocks = random_blocks(kind, 64, 512, seed=rows)
    repacked = to_int8_form(blocks)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7))
    x[0, :32] = 0.0                                   # a block of zeros: scale 0
    want, size = quantized_product(x, blocks.dequantize())
    got = kernels.gemm(repacked.kind, x, repacked.codes, repacked.scales, repacked.minima)
    assert ((got.double() - want).abs() / size).max() < 1e-5
    exact = x.double() @ blocks.dequantize().double().T      # and int8's own error is small
    assert ((got.double() - exact).norm() / exact.norm()) < 0.02


@needs_kernels
@pytest.mark.parametrize("level", runnable_isa_levels())
@pytest.mark.parametrize("kind", FORMS)
def test_every_levels_int8_loop_computes_the_same_products(level, kind):
    """The AVX2 loop (vpmaddubsw, unsigned codes shifted to signed), AVX-512 VNNI's and
    the portable one sum the same integers: only the fp32 scaling's order differs."""
    from engine.kernels import load_native_kernels

    with cpu_isa(level):
        built = load_native_kernels()
    blocks = random_blocks(kind, 48, 1024, seed=11)
    blocks.codes[:, :32] = {"Q4_1": 0xFF, "Q8_16": 31}.get(kind, 127)   # the largest codes
    blocks.codes[:, 32:64] = {"Q4_1": 0, "Q8_16": -32, "Q5_1": 0}.get(kind, -128)
    repacked = to_int8_form(blocks)
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(2))
    x[1, :128] = -x[1, :128].abs()                            # x of one sign on those
    want, size = quantized_product(x, blocks.dequantize())
    got = built.gemm(repacked.kind, x, repacked.codes, repacked.scales, repacked.minima)
    assert ((got.double() - want).abs() / size).max() < 1e-5


@needs_kernels
def test_columns_must_come_in_whole_groups():
    whole = to_int8_form(random_blocks("Q4_1", 32, 64, seed=3))
    with pytest.raises(RuntimeError, match="kernel failed"):   # 24 columns: refused
        kernels.gemm(whole.kind, torch.randn(2, 64), whole.codes[:24], whole.scales[:24],
                     whole.minima[:24])


@pytest.fixture(scope="module")
def int8_model(mixed_path):  # noqa: F811
    return load_model(str(mixed_path), dtype="int8-activations", progress=False)


@needs_kernels
def test_every_projection_is_repacked_and_keeps_no_dense_copy(int8_model, mixed_path):  # noqa: F811
    module = int8_model.module
    projections = [m for layer in module.layers for m in layer.modules()
                   if isinstance(m, BlockLinear)]
    assert len(projections) == 4 * len(module.layers)
    assert all(p.weight is None and p.packed is None for p in projections)
    loop = default_kernels().int8_path         # each type in its form on this build's loop
    q4_1, q8_0, q5_1 = (int8_form_for(kind, loop) for kind in ("Q4_1", "Q8_0", "Q5_1"))
    assert {part.kind for p in projections for part in p.parts} == {q4_1, q8_0, q5_1}
    qkv = module.layers[0].self_attn.qkv_proj
    assert [part.kind for part in qkv.parts] == [q4_1, q8_0]          # Q4_1 q, k; Q8_0 v
    assert module.lm_head.kind == q8_0         # tied: the table repacked once, for both
    assert module.embed_tokens.blocks.codes.data_ptr() == module.lm_head.codes.data_ptr()
    exact = load_model(str(mixed_path), progress=False).module
    ids = torch.tensor([[3, 700, 49151]])
    assert torch.equal(module.embed_tokens(ids), exact.embed_tokens(ids))


@needs_kernels
def test_the_int8_stack_is_bit_identical_to_its_layers(int8_model):
    assert_fast_stack_serves_its_rows(int8_model)


@needs_kernels
def test_logits_stay_within_int8_error_of_float32(int8_model, mixed_path):  # noqa: F811
    exact = load_model(str(mixed_path), progress=False)
    ids = exact.tokenizer.encode("The capital of France is Paris, and the")
    want, got = exact.prompt_logits(ids), int8_model.prompt_logits(ids)
    logprobs, int8_logprobs = want.log_softmax(-1), got.log_softmax(-1)
    divergence = (logprobs.exp() * (logprobs - int8_logprobs)).sum(-1)   # KL per position
    assert 0 < divergence.max() < 0.05            # quantized (not the float32 path), yet close
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@needs_kernels
def test_the_generic_level_refuses_int8_activations(mixed_path):  # noqa: F811
    with cpu_isa("generic"), pytest.raises(ValueError, match="generic level.*use dtype float32"):
        load_model(str(mixed_path), dtype="int8-activations", progress=False)


def test_int8_activations_need_a_gguf_file(tiny_models):
    path, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="int8-activations multiplies a GGUF"):
        load_model(path, dtype="int8-activations", progress=False)

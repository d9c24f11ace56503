"""dtype bf16-weights on a GGUF model: small steps keep the exact fp32 block kernels,
large ones multiply bf16 weights; the LM head's likely tokens are recomputed in fp32;
and the native kernels give the same numbers whether their parts run on their own
helpers or on torch's OpenMP threads."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.kernels.cpu_threads import openmp_entry_points, release_openmp_pool
from engine.kernels import load_native_kernels
from engine.models.block_weights import BF16_KERNEL_ROWS, BlockLinear, parse_blocks
from engine.models.fast_decode import FastDecodeLayer
from engine.models.mixed_precision import RESCORED_CANDIDATES, Bf16RescoredHead

from engine.models.packed_linear import packing_available
from tests.helpers import (block_kernel_rows, cpu_isa, layer_executors, needs_bf16_gemm,
                           needs_bf16_packing)

from .test_block_weights import random_gguf_bytes


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


@pytest.mark.parametrize("rows", [1, BF16_KERNEL_ROWS, BF16_KERNEL_ROWS + 1, 40])
def test_bf16_dense_block_linear_is_exact_on_small_steps_only(kernels, rows):
    blocks = parse_blocks("Q4_1", random_gguf_bytes("Q4_1", 96, 576, seed=rows))
    weight = blocks.dequantize()
    exact = BlockLinear(weight, None, blocks, kernels)
    mixed = BlockLinear(weight, None, blocks, kernels, bf16_dense=True)
    x = torch.randn(rows, 576)
    got = mixed(x)
    assert got.dtype == torch.float32
    if rows <= BF16_KERNEL_ROWS:          # the block kernel, as in float32 mode
        assert torch.equal(got, exact(x))
    else:                                 # bf16 inputs and weights, fp32 out
        assert torch.equal(got, F.linear(x.bfloat16(), weight.bfloat16()).float())
        assert not torch.equal(got, F.linear(x, weight))


def test_rescored_head_gives_fp32_logits_for_the_likely_tokens():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 64, generator=generator)
    hidden = torch.randn(40, 64, generator=generator)
    head = Bf16RescoredHead(weight, None)
    got, want = head(hidden), hidden @ weight.T
    top = want.topk(RESCORED_CANDIDATES // 2, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, want.topk(64, dim=-1).indices, False)
    assert not torch.allclose(got[rest], want[rest], rtol=1e-5, atol=1e-5)   # bf16 elsewhere
    assert (got - want).abs().max() < 0.5


def test_rescored_head_picks_a_recomputed_token_even_in_flat_rows():
    """Between 16 and 32 bf16 logits step by 0.125: 200 logits near 20.1 all round up
    to 20.125, above the fp32 values of the 16 recomputed ones; the best token must
    still be a recomputed one, with its fp32 logit."""
    generator = torch.Generator().manual_seed(4)
    direction = torch.randn(64, generator=generator)
    direction /= direction.norm()
    near_ties = direction + 1e-5 * torch.randn(200, 64, generator=generator)
    weight = torch.cat([near_ties, 0.1 * torch.randn(800, 64, generator=generator)])
    hidden = torch.stack([direction * scale for scale in (20.1, 24.1, 30.1)])
    got, want = Bf16RescoredHead(weight, None)(hidden), hidden @ weight.T
    best = got.argmax(-1, keepdim=True)
    torch.testing.assert_close(got.gather(1, best), want.gather(1, best), rtol=1e-6, atol=1e-5)


def test_native_head_finish_equals_the_torch_ops(kernels):
    """kernels/head_rescore.c against Bf16RescoredHead.rescore on the same bf16 logits:
    same candidates, same cap. Rows whose 16th and 17th bf16 logits tie may
    pick either, so only rows without such a tie are compared."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(5000, 96, generator=generator)
    hidden = torch.randn(48, 96, generator=generator) * 2
    head = Bf16RescoredHead(weight, None)
    assert head.kernels is not None
    approx = F.linear(hidden.bfloat16(), weight.bfloat16())
    native = kernels.rescore_head(approx, hidden, weight, RESCORED_CANDIDATES)
    reference = head.rescore(approx, hidden)
    ordered = approx.float().sort(dim=-1, descending=True).values
    untied = ordered[:, RESCORED_CANDIDATES - 1] > ordered[:, RESCORED_CANDIDATES]
    assert untied.sum() > 24
    torch.testing.assert_close(native[untied], reference[untied], rtol=1e-5, atol=1e-5)
    assert torch.equal(head(hidden).argmax(-1)[untied], reference.argmax(-1)[untied])
    with pytest.raises(ValueError, match="candidates"):
        kernels.rescore_head(approx, hidden, weight, 65)


def test_rescored_head_hands_small_steps_to_the_exact_head(kernels):
    blocks = parse_blocks("Q8_0", random_gguf_bytes("Q8_0", 200, 64, seed=3))
    weight = blocks.dequantize()
    exact = BlockLinear(weight, None, blocks, kernels)
    head = Bf16RescoredHead(weight, exact)
    assert head.exact_rows == BF16_KERNEL_ROWS
    small = torch.randn(BF16_KERNEL_ROWS, 64)
    assert torch.equal(head(small), exact(small))
    large = torch.randn(BF16_KERNEL_ROWS + 1, 64)
    assert not torch.equal(head(large), exact(large))


def test_kernels_on_torchs_openmp_threads_give_the_same_numbers(kernels):
    assert openmp_entry_points() is not None, "torch's PyPI wheels bring libgomp"
    assert release_openmp_pool()
    blocks = parse_blocks("Q4_1", random_gguf_bytes("Q4_1", 192, 576, seed=5))
    x = torch.randn(8, 576)
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(512, 3, 64, generator=generator) for _ in range(2))
    query = torch.randn(6, 9, 64, generator=generator)
    slots = torch.randperm(512, generator=generator)[:6 * 80].view(6, 80)
    lengths = torch.tensor([80, 3, 41, 80, 1, 17])

    def run():
        return (kernels.gemm("Q4_1", x, blocks.codes, blocks.scales, blocks.minima),
                kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.125))

    try:
        kernels.set_torch_threaded(False)
        own_pool = run()
        kernels.set_torch_threaded(True)
        assert kernels.num_threads == torch.get_num_threads()  # OpenMP took the parts
        on_openmp = run()
    finally:
        kernels.set_torch_threaded(False)
    assert torch.equal(own_pool[0], on_openmp[0]) and torch.equal(own_pool[1], on_openmp[1])
    torch.testing.assert_close(own_pool[0], x @ blocks.dequantize().T, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@needs_bf16_gemm
def test_default_model_in_bf16_weights_keeps_small_steps_exact():
    """With an fp32 KV cache (the default bf16 one rounds K/V), steps of up to
    BF16_KERNEL_ROWS rows give float32's logprobs."""
    mixed = load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False,
                       kv_cache_dtype="float32")
    exact = load_model("smollm2-135m-instruct", progress=False)
    layers = list(mixed.module.layers)
    projections = [m for layer in layers for m in layer.modules() if isinstance(m, BlockLinear)]
    assert len(projections) == 4 * len(layers)
    assert all(p.packed is not None and p.packed.pairs is not None        # the native GEMM's
               and p.weight is None for p in projections)
    assert all((p.packed.onednn is not None) == packing_available(torch.bfloat16)
               for p in projections)                                    # and oneDNN's copy
    assert all(p.max_rows == BF16_KERNEL_ROWS for p in projections)
    assert all(isinstance(e, FastDecodeLayer)
               for e in layer_executors(mixed.module, FastDecodeLayer))
    assert isinstance(mixed.module.lm_head, Bf16RescoredHead)
    tokenizer = exact.tokenizer
    prompts = [tokenizer.encode(text) for text in ("The three primary colors are",
                                                  "def add(a, b):")]
    config = GenerationConfig(max_new_tokens=24)
    # every step (prefill chunks included) within BF16_KERNEL_ROWS: all on the blocks
    small_steps = ContinuousBatchingConfig(return_logprobs=True, max_batch_tokens=BF16_KERNEL_ROWS)
    got = list(mixed.generate_batch(prompts, config, small_steps).values())
    want = list(exact.generate_batch(prompts, config, small_steps).values())
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    for mixed_output, exact_output in zip(got, want):
        assert mixed_output.logprobs == pytest.approx(exact_output.logprobs, abs=1e-5)
    # one large prefill step: the prompt's last-row logits are bf16 except the top ones
    long_prompt = tokenizer.encode("Write a short story about a lighthouse keeper. " * 4)
    rescored, reference = mixed.prompt_logits(long_prompt)[-1], exact.prompt_logits(long_prompt)[-1]
    assert rescored.argmax() == reference.argmax()
    assert (rescored - reference).abs().max() < 0.5


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_kernel_equals_torch(kernels, dtype, activation):
    """act(gate) * up within fp32 rounding of torch's, a bf16 result within one
    rounding of it (torch's GELU, 0.5 g (1 + tanh(u)), loses digits to cancellation
    where g is negative; the kernel's logistic form does not, so they differ there)."""
    generator = torch.Generator().manual_seed(6)
    gate_up = (4 * torch.randn(37, 2 * 200, generator=generator)).to(dtype)
    gate_up[0, 0], gate_up[1, 0], gate_up[2, 0] = float("nan"), -200.0, 200.0
    got = kernels.gated_activation(gate_up, activation)
    gate, up = gate_up.float().split(200, dim=-1)
    act = F.silu if activation == "silu" else partial(F.gelu, approximate="tanh")
    want = (act(gate) * up).to(dtype)
    assert got.dtype == dtype and got.shape == (37, 200)
    assert torch.isnan(got[0, 0]) and got[1, 0] == 0 and got[2, 0] == want[2, 0]
    if dtype == torch.float32:
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-5, atol=1e-5)
    else:
        ulp = want[1:].float().abs().clamp_min(1e-3) * 2 ** -7
        assert torch.all((got[1:].float() - want[1:].float()).abs() <= ulp)
    with pytest.raises(ValueError, match="activation"):
        kernels.gated_activation(gate_up, "relu")


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16_packing)])
def test_large_steps_of_the_fused_mlp_run_on_packed_weights(kernels, bf16):
    from engine.models.block_weights import FusedBlockMLP
    from engine.models.layers import GatedMLP

    hidden, inter, rows = 64, 96, block_kernel_rows() + 1     # past the kernels' steps
    gate_up = parse_blocks("Q4_1", random_gguf_bytes("Q4_1", 2 * inter, hidden, seed=1))
    down = parse_blocks("Q4_1", random_gguf_bytes("Q4_1", hidden, inter, seed=2))
    x = torch.randn(rows, hidden)
    want = GatedMLP(BlockLinear(gate_up.dequantize(), None, gate_up, kernels),   # modules,
                    BlockLinear(down.dequantize(), None, down, kernels), "silu")(x)   # fp32
    packed = [BlockLinear(blocks.dequantize(), None, blocks, kernels, bf16_dense=bf16, pack=True)
              for blocks in (gate_up, down)]
    assert all(projection.packed is not None for projection in packed)
    mlp = GatedMLP(*packed, "silu", FusedBlockMLP(*packed, kernels))
    got = mlp(x)
    assert got.dtype == torch.float32 and rows > mlp.gate_up_proj.max_rows
    if bf16:
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert not torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_without_the_native_bf16_gemm_a_gguf_keeps_float32s_methods():
    """On the generic level (no native bf16 GEMM: bf16 products would run on torch's
    widening loops, slower than the blocks) bf16-weights keeps a GGUF's blocks and
    block head as float32 does, and only its KV cache is bf16: with an fp32 cache the
    logprobs are float32's exactly."""
    with cpu_isa("generic"):
        mixed = load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)
        same = load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False,
                          kv_cache_dtype="float32")
        exact = load_model("smollm2-135m-instruct", progress=False)
        assert mixed.module.kv_cache_dtype == torch.bfloat16
        layers = list(mixed.module.layers)
        projections = [m for layer in layers for m in layer.modules()
                       if isinstance(m, BlockLinear)]
        assert len(projections) == 4 * len(layers)
        assert all(p.packed is None or p.packed.dtype == torch.float32    # float32's dense
                   for p in projections)                                # copy past its rows
        assert all(p.weight is None or p.weight.dtype == torch.float32 for p in projections)
        assert isinstance(mixed.module.lm_head, BlockLinear)
        prompts = [exact.tokenizer.encode(text) for text in ("The three primary colors are",
                                                            "def add(a, b):")]
        config = GenerationConfig(max_new_tokens=16)
        logprobs = ContinuousBatchingConfig(return_logprobs=True)
        got = list(same.generate_batch(prompts, config, logprobs).values())
        want = list(exact.generate_batch(prompts, config, logprobs).values())
        assert [o.logprobs for o in got] == [o.logprobs for o in want]
        bf16_cache = list(mixed.generate_batch(prompts, config, logprobs).values())
        assert [o.generated_tokens for o in bf16_cache] == [o.generated_tokens for o in want]

"""The native bf16 GEMM (engine/kernels/bf16_gemm.c) and its weight layout, on the
AVX512-BF16 loop, on AMX tiles (bf16_amx.c) and on AVX2's widening tile
(bf16_tile_256.h): products of bf16 rows and weights
equal an fp64 product of the same bf16 values up to fp32 accumulation, at every row
and column remainder of the loops' 8- and 4-row, 48-column tiles and of AMX's
16-row tiles, 32-column panels and 256-row blocks, K a multiple of 32 or not; bf16
output is that result rounded; packed_linear sends small steps to it and large ones
to oneDNN (every step where oneDNN holds no copy); a gated MLP's paired gate/up gives the unfused activation of its fp32
sums, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import default_kernels, load_native_kernels
from engine.models.packed_linear import (NATIVE_BF16_MAX_ROWS, PackedWeight, bf16_pairs,
                                         gate_pairs, pack_weight, packed_gated, packed_linear)
from tests.helpers import cpu_isa, runnable_isa_levels


@pytest.fixture(scope="module", params=["avx512-bf16", "amx", "widening"])
def kernels(request):
    """The kernels with the GEMM on the AVX512-BF16 loop, then on AMX tiles (where the
    CPU has them; K a multiple of 32 takes the tiles, others the loop), then on the
    avx2 level's widening tile (the selected level while it runs, so pack_weight and
    packed_linear take it too)."""
    if request.param == "widening":
        if "avx2" not in runnable_isa_levels():
            pytest.skip("this CPU has no AVX2")
        with cpu_isa("avx2"):
            built = default_kernels()
            assert built is not None and built.bf16_gemm_kind == "widening"
            yield built
        return
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    if built.bf16_gemm_kind != "avx512_bf16":
        pytest.skip("this CPU has no AVX512-BF16 (the widening tile serves it)")
    serving = built.amx_enabled
    if built.enable_amx(request.param == "amx") != (request.param == "amx"):
        built.enable_amx(serving)
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    yield built
    built.enable_amx(serving)


def test_pairs_layout_worked_example():
    weight = torch.arange(20 * 4, dtype=torch.float32).view(20, 4).bfloat16()
    pairs = bf16_pairs(weight)
    assert pairs.shape == (2, 2, 16, 2)
    assert pairs[1, 1, 3, 0] == weight[19, 2] and pairs[1, 1, 3, 1] == weight[19, 3]
    assert pairs[0, 0, 5, 1] == weight[5, 1]
    assert torch.all(pairs[1, :, 4:] == 0)                          # rows 20..31: padding


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 32, 33, 50, 300])
@pytest.mark.parametrize("in_features,out_features",
                         [(64, 48), (576, 100), (2, 17), (130, 15), (96, 16)])
def test_products_equal_fp64_of_the_bf16_values(kernels, rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    want = x.double() @ weight.double().T
    got = kernels.bf16_gemm(x, bf16_pairs(weight), out_features, torch.float32)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    rounded = kernels.bf16_gemm(x, bf16_pairs(weight), out_features, torch.bfloat16)
    assert torch.equal(rounded, got.bfloat16())


def test_strided_rows_and_odd_k(kernels):
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(10, 96, generator=generator).bfloat16()
    x = wide[:, :64]                                   # rows 96 apart
    weight = torch.randn(40, 64, generator=generator).bfloat16()
    got = kernels.bf16_gemm(x, bf16_pairs(weight), 40, torch.float32)
    want = kernels.bf16_gemm(x.contiguous(), bf16_pairs(weight), 40, torch.float32)
    assert torch.equal(got, want)
    odd = torch.randn(3, 5, generator=generator).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 GEMM failed"):
        kernels.bf16_gemm(odd, torch.zeros(1, 3, 16, 2, dtype=torch.bfloat16), 16, torch.float32)


def test_packed_linear_takes_the_native_gemm_for_small_steps_only(kernels):
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    packed = pack_weight(weight)
    assert packed.pairs is not None and packed.dtype == torch.bfloat16
    for rows in (4, NATIVE_BF16_MAX_ROWS, NATIVE_BF16_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        native = kernels.bf16_gemm(x, packed.pairs, 96, torch.float32)
        got = packed_linear(x, packed, torch.float32)
        if rows <= NATIVE_BF16_MAX_ROWS or packed.onednn is None:   # (oneDNN packs no bf16)
            assert torch.equal(got, native)            # fp32 accumulators, not rounded
        else:
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, None, "none", [], "")
            assert torch.equal(got, onednn.float())    # oneDNN rounds through bf16
        torch.testing.assert_close(got, x.float() @ weight.float().T, rtol=1e-2, atol=2e-2)
    assert packed_linear(x, packed).dtype == torch.bfloat16
    odd = pack_weight(torch.randn(8, 5).bfloat16())                     # odd K: oneDNN only
    assert odd is None or odd.pairs is None
    assert pack_weight(torch.randn(8, 6)).pairs is None                 # fp32: oneDNN only


def test_without_a_onednn_copy_the_native_gemm_takes_every_step(kernels):
    """Where oneDNN cannot pack bf16 weights (AVX2 CPUs) pack_weight keeps the pairs
    alone: large steps run on the native GEMM too, not on torch's bf16 loops."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 64, generator=generator).bfloat16()
    packed = PackedWeight(None, bf16_pairs(weight), 40, kernels)
    assert packed.dtype == torch.bfloat16
    for rows in (3, NATIVE_BF16_MAX_ROWS + 50):
        x = torch.randn(rows, 64, generator=generator).bfloat16()
        got = packed_linear(x, packed, torch.float32)
        assert torch.equal(got, kernels.bf16_gemm(x, packed.pairs, 40, torch.float32))


def test_paired_gate_up_gives_the_activation_of_its_fp32_sums(kernels):
    generator = torch.Generator().manual_seed(11)
    inter, in_features = 48, 64
    weight = torch.randn(2 * inter, in_features, generator=generator).bfloat16()
    plain, paired = pack_weight(weight), pack_weight(weight)
    gate_pairs(paired)
    assert paired.gated_inter == inter and plain.gated_inter == 0
    assert not torch.equal(paired.pairs, plain.pairs)          # reordered blocks
    for rows in (1, 9, 32, NATIVE_BF16_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        sums = packed_linear(x, plain, torch.float32)           # [rows, 2I], gate first
        assert torch.equal(packed_linear(x, paired, torch.float32), sums)
        got = packed_gated(x, paired, kernels)
        assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
        if paired.native_rows(rows):          # silu of the fp32 sums, rounded once
            assert torch.equal(got, kernels.gated_activation(sums).bfloat16())
        else:                                 # oneDNN's bf16 product, then gated_activation
            assert torch.equal(got, kernels.gated_activation(packed_linear(x, plain)))


def test_paired_gate_up_with_gelu_tanh(kernels):
    """Gemma's gelu_pytorch_tanh from the fp32 sums: torch's activation of the same
    sums within a bf16 rounding (the kernel's exp differs from torch's by ulps);
    past the native GEMM's rows packed_gated leaves GELU to the modules (None)."""
    generator = torch.Generator().manual_seed(12)
    inter, in_features = 64, 96
    weight = torch.randn(2 * inter, in_features, generator=generator).bfloat16()
    paired = pack_weight(weight)
    gate_pairs(paired)
    x = torch.randn(40, in_features, generator=generator).bfloat16() * 2
    sums = packed_linear(x, paired, torch.float32)
    gate, up = sums.split(inter, dim=1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    got = packed_gated(x, paired, kernels, "gelu_tanh").float()
    assert not torch.equal(got, packed_gated(x, paired, kernels, "silu").float())
    ulp = want.abs().clamp_min(1e-3) * 2 ** -7
    assert torch.all((got - want).abs() <= ulp)
    big = torch.randn(NATIVE_BF16_MAX_ROWS + 1, in_features, generator=generator).bfloat16()
    if paired.onednn is not None:
        assert packed_gated(big, paired, kernels, "gelu_tanh") is None
    else:                                     # the native GEMM takes every step
        assert packed_gated(big, paired, kernels, "gelu_tanh").shape == (big.shape[0], inter)


def test_amx_tiles_take_the_products_where_the_cpu_has_them():
    """Where AMX serves, K a multiple of 32 runs on the tiles: the same products as the
    loop's to fp32 accumulation, summed in another order (so not all bit-equal); K of
    another size stays on the loop, bit for bit."""
    built = load_native_kernels()
    if built is None or not built.has_bf16_gemm:
        pytest.skip("this CPU has no AVX512-BF16")
    serving = built.amx_enabled
    try:
        if not built.enable_amx(True):
            pytest.skip("this CPU (or its kernel) gives no AMX tiles")
        generator = torch.Generator().manual_seed(21)
        results = {}
        for in_features in (576, 130):
            x = torch.randn(40, in_features, generator=generator).bfloat16()
            pairs = bf16_pairs(torch.randn(100, in_features, generator=generator).bfloat16())
            for amx in (True, False):
                built.enable_amx(amx)
                results[in_features, amx] = built.bf16_gemm(x, pairs, 100, torch.float32)
        assert not torch.equal(results[576, True], results[576, False])
        torch.testing.assert_close(results[576, True], results[576, False], rtol=1e-5, atol=1e-4)
        assert torch.equal(results[130, True], results[130, False])
    finally:
        built.enable_amx(serving)

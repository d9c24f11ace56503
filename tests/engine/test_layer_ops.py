"""The native elementwise layer ops (kernels/layer_ops.c) against torch: RoPE with the
cache write equals the module path bit for bit; the RMSNorm equals torch's up to the
order of its sum, and its bf16 output is its fp32 output rounded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import load_native_kernels
from engine.models.layers import RMSNorm, apply_rotary


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rope_store_equals_apply_rotary_and_index_copy(kernels, tokens):
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim, num_slots = 6, 2, 32, 100
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator) * 4
    angles = torch.rand(tokens, dim // 2, generator=generator) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.randperm(num_slots, generator=generator)[:tokens]
    keys, values = torch.zeros(num_slots, kv_heads, dim), torch.zeros(num_slots, kv_heads, dim)

    heads_view = qkv.view(tokens, heads + 2 * kv_heads, dim)
    rotated = apply_rotary(heads_view[:, :heads + kv_heads], cos, sin)
    want_keys, want_values = keys.clone(), values.clone()
    want_keys[slots] = rotated[:, heads:]
    want_values[slots] = heads_view[:, heads + kv_heads:]
    want_q = rotated[:, :heads].clone()

    kernels.rope_store(qkv, heads, cos, sin, slots, keys, values)
    assert torch.equal(qkv.view(tokens, -1, dim)[:, :heads], want_q)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@pytest.mark.parametrize("rows,n", [(1, 576), (64, 576), (3, 40)])
def test_rms_norm_matches_torch(kernels, rows, n):
    generator = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=generator) * 3
    weight = torch.rand(n, generator=generator) + 0.5
    got = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (n,), weight, 1e-5), rtol=2e-6, atol=1e-6)
    rounded = kernels.rms_norm(x, weight, 1e-5, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())


def test_rope_store_refuses_slots_outside_the_cache(kernels):
    qkv = torch.zeros(2, 4 * 16)
    cache = torch.zeros(8, 1, 16)
    with pytest.raises(IndexError, match=r"outside the KV cache"):
        kernels.rope_store(qkv, 2, torch.ones(2, 16), torch.zeros(2, 16), torch.tensor([3, 8]),
                           cache, cache.clone())


def test_rope_store_rounds_into_a_bf16_cache(kernels):
    generator = torch.Generator().manual_seed(9)
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=generator)
    cos, sin = torch.ones(3, dim), torch.zeros(3, dim)        # the identity rotation
    keys, values = torch.zeros(8, kv_heads, dim, dtype=torch.bfloat16), torch.zeros(
        8, kv_heads, dim, dtype=torch.bfloat16)
    slots = torch.tensor([5, 0, 2])
    expected = qkv.view(3, -1, dim).clone()
    kernels.rope_store(qkv, heads, cos, sin, slots, keys, values)
    assert torch.equal(keys[slots], expected[:, heads:heads + kv_heads].bfloat16())
    assert torch.equal(values[slots], expected[:, heads + kv_heads:].bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_half_precision_norm_is_transformers_arithmetic(dtype, offset):
    """Half-precision inputs take torch's norm op, which computes in fp32 and rounds
    once (fewer kernels in a decode step's graph); on CPU its result is transformers'
    op-by-op one bit for bit, with and without Gemma's (1 + weight)."""
    torch.manual_seed(2)
    norm = RMSNorm(576, 1e-5, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    x = (torch.randn(7, 576) * 3).to(dtype)
    check_norm_of(norm, x, offset, dtype)
    # per-head norms (Qwen3's q/k norms) over a strided [T, H, D] view
    heads = RMSNorm(64, 1e-6, offset=offset).to(dtype)
    with torch.no_grad():
        heads.weight.normal_()
    qkv = (torch.randn(5, 12 * 64) * 2).to(dtype)
    check_norm_of(heads, qkv[:, 64:9 * 64].view(5, 8, 64), offset, dtype)


def check_norm_of(norm: RMSNorm, x: torch.Tensor, offset: float, dtype: torch.dtype) -> None:
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.eps)
    want = ((wide * (offset + norm.weight.float())).to(dtype) if offset
            else norm.weight * wide.to(dtype))
    got = norm(x)
    assert got.dtype == dtype and torch.equal(got, want)

"""The native decode-attention kernel equals attention computed with torch over the
same paged cache: GQA, contexts of different lengths with padding after them, slots
scattered over the cache (refused outside it), head sizes on the vector paths
(AVX-512: multiples of 16 such as 16, 48, 64, 128; AVX2: multiples of 8, whose values
are swept 64 columns and at most 8 vectors at a time, so 16, 24, 32 and 96 each take
another sweep shape) and off them (10)."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kernels import load_native_kernels


@pytest.fixture(scope="module")
def kernels():
    built = load_native_kernels()
    assert built is not None, "a C compiler is part of this project's CI machine"
    return built


def reference(query, keys, values, slots, lengths, scale):
    """softmax(q k^T * scale) v per request and head, from gathered slots."""
    batch, heads, dim = query.shape
    group = heads // keys.shape[1]
    out = torch.empty_like(query)
    for b in range(batch):
        context = slots[b, :lengths[b]]
        k = keys[context].repeat_interleave(group, dim=1)         # [L, H, D]
        v = values[context].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b], k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dim", [64, 128, 48, 10, 16, 24, 32, 96])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_torch_attention(kernels, dim, heads, kv_heads):
    generator = torch.Generator().manual_seed(dim * 100 + heads)
    num_slots, batch, width = 512, 5, 70
    keys = torch.randn(num_slots, kv_heads, dim, generator=generator)
    values = torch.randn(num_slots, kv_heads, dim, generator=generator)
    query = torch.randn(batch, heads, dim, generator=generator)
    lengths = torch.tensor([1, 70, 33, 2, 64])
    slots = torch.randperm(num_slots, generator=generator)[:batch * width].view(batch, width)
    for b in range(batch):                      # padding repeats the last real slot
        slots[b, lengths[b]:] = slots[b, lengths[b] - 1]
    scale = dim ** -0.5
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, scale)
    torch.testing.assert_close(got, reference(query, keys, values, slots, lengths, scale),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (10, 4, 4)])
def test_long_contexts_split_over_threads_merge_exactly(kernels, monkeypatch, dim, heads, kv_heads):
    """One or two requests with long contexts: each context is cut into chunks whose
    partial softmaxes are merged; the result is still the whole softmax."""
    monkeypatch.setattr(kernels, "num_threads", 4)
    generator = torch.Generator().manual_seed(7)
    num_slots, width = 4096, 1500
    keys = torch.randn(num_slots, kv_heads, dim, generator=generator) * 3
    values = torch.randn(num_slots, kv_heads, dim, generator=generator)
    query = torch.randn(2, heads, dim, generator=generator)
    lengths = torch.tensor([1500, 300])
    slots = torch.randperm(num_slots, generator=generator)[:2 * width].view(2, width)
    slots[1, 300:] = slots[1, 299]
    for batch in (1, 2):
        got = kernels.paged_decode_attention(query[:batch], keys, values, slots[:batch],
                                             lengths[:batch], dim ** -0.5)
        want = reference(query[:batch], keys, values, slots[:batch], lengths[:batch], dim ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_query_rows_may_be_strided(kernels):
    """A decode step hands over the q part of its fused qkv rows without a copy."""
    generator = torch.Generator().manual_seed(3)
    keys, values = torch.randn(64, 3, 64, generator=generator), torch.randn(64, 3, 64,
                                                                           generator=generator)
    fused = torch.randn(4, 9 + 2 * 3, 64, generator=generator)
    query = fused[:, :9]                              # [4, 9, 64], rows 15 heads apart
    slots, lengths = torch.randperm(64, generator=generator)[:40].view(4, 10), torch.tensor(
        [10, 3, 7, 1])
    strided = kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.125)
    assert torch.equal(strided, kernels.paged_decode_attention(query.contiguous(), keys, values,
                                                               slots, lengths, 0.125))
    torch.testing.assert_close(strided, reference(query, keys, values, slots, lengths, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_share_their_requests_slot_row(kernels, monkeypatch, threads):
    """A mixed step as one call: query i of a prefill chunk starting at position s
    attends to its request's first s + i + 1 slots (causal), decodes to all of theirs."""
    monkeypatch.setattr(kernels, "num_threads", threads)
    generator = torch.Generator().manual_seed(21)
    keys = torch.randn(200, 3, 64, generator=generator)
    values = torch.randn(200, 3, 64, generator=generator)
    slots = torch.randperm(200, generator=generator)[:3 * 40].view(3, 40)
    # request 0: chunk at positions 30..39; request 1: prompt 0..6; request 2: decode at 25
    slot_rows = torch.tensor([0] * 10 + [1] * 7 + [2])
    lengths = torch.tensor(list(range(31, 41)) + list(range(1, 8)) + [26])
    query = torch.randn(18, 9, 64, generator=generator)
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.125,
                                         slot_rows=slot_rows)
    want = reference(query, keys, values, slots[slot_rows], lengths, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.125,
                                       slot_rows=slot_rows + 1)     # row 3 does not exist


@pytest.mark.parametrize("threads", [1, 2])
def test_window_rows_start_inside_their_requests_slot_row(kernels, monkeypatch, threads):
    """Sliding-window rows: query b reads lengths[b] slots of its row from entry
    starts[b]. Window 4: a chunk at positions 10..12 whose row holds positions 7..12
    reads entries 0..3, 1..4, 2..5; a decode whose row is its window, all of it."""
    monkeypatch.setattr(kernels, "num_threads", threads)
    generator = torch.Generator().manual_seed(22)
    keys = torch.randn(100, 2, 32, generator=generator)
    values = torch.randn(100, 2, 32, generator=generator)
    slots = torch.randperm(100, generator=generator)[:2 * 6].view(2, 6)
    slot_rows, starts = torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 2, 0])
    lengths = torch.tensor([4, 4, 4, 4])
    query = torch.randn(4, 4, 32, generator=generator)
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.2,
                                         slot_rows=slot_rows, starts=starts)
    windows = torch.stack([slots[r, s:s + 4] for r, s in zip(slot_rows, starts)])
    want = reference(query, keys, values, windows, lengths, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unshifted = kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.2,
                                               slot_rows=slot_rows)
    assert not torch.allclose(got[1:3], unshifted[1:3])
    for bad in (torch.tensor([0, 1, 3, 0]), torch.tensor([-1, 0, 0, 0])):   # past / before
        with pytest.raises(RuntimeError):
            kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.2,
                                           slot_rows=slot_rows, starts=bad)


def test_kernel_refuses_what_it_cannot_read(kernels):
    keys = torch.zeros(8, 1, 16)
    query = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="slots"):
        kernels.paged_decode_attention(query, keys, keys, torch.zeros(1, 4, dtype=torch.int32),
                                       torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError):         # a context longer than its slot row
        kernels.paged_decode_attention(query, keys, keys, torch.zeros(1, 4, dtype=torch.long),
                                       torch.tensor([5]), 1.0)


def test_kernel_refuses_slots_outside_the_cache(kernels):
    """A slot a query may read outside [0, num_slots) is an IndexError, not a read of
    memory past the cache. Each row of slots is checked from entry 0 (a blocked
    prefill run packs its row's keys from there, a window's start or not) to the
    furthest entry its queries read; entries past that may hold anything."""
    generator = torch.Generator().manual_seed(23)
    keys = torch.randn(50, 2, 16, generator=generator)
    values = torch.randn(50, 2, 16, generator=generator)
    query = torch.randn(3, 4, 16, generator=generator)
    slots = torch.randperm(50, generator=generator)[:12].view(2, 6)
    slot_rows, starts = torch.tensor([0, 0, 1]), torch.tensor([1, 1, 0])
    lengths = torch.tensor([2, 3, 5])            # row 0: entries 1..3, row 1: 0..4
    padded = slots.clone()
    padded[0, 4:], padded[1, 5] = 10**9, 50      # past every query's reach
    got = kernels.paged_decode_attention(query, keys, values, padded, lengths, 0.25,
                                         slot_rows=slot_rows, starts=starts)
    torch.testing.assert_close(got, kernels.paged_decode_attention(
        query, keys, values, slots, lengths, 0.25, slot_rows=slot_rows, starts=starts))
    for row, entry, slot in ((0, 3, 50), (0, 0, -1), (1, 0, -1), (1, 4, 10**12)):
        bad = slots.clone()
        bad[row, entry] = slot
        with pytest.raises(IndexError, match="outside the KV cache"):
            kernels.paged_decode_attention(query, keys, values, bad, lengths, 0.25,
                                           slot_rows=slot_rows, starts=starts)


def test_a_windowed_bf16_run_refuses_slots_before_its_start(kernels):
    """Ten rows of one chunk in a window of 4 (a run for the blocked prefill tiles
    where the CPU has them): the run reads its row from entry 0, so a bad slot there,
    before every query's start, is refused too (it was read past the cache)."""
    generator = torch.Generator().manual_seed(24)
    keys = torch.randn(64, 1, 64, generator=generator).bfloat16()
    values = torch.randn(64, 1, 64, generator=generator).bfloat16()
    query = torch.randn(10, 2, 64, generator=generator)
    slots = torch.randperm(64, generator=generator)[:16].view(1, 16)
    slot_rows, starts = torch.zeros(10, dtype=torch.long), torch.arange(3, 13)
    lengths = torch.full((10,), 4)
    kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.125,
                                   slot_rows=slot_rows, starts=starts)
    bad = slots.clone()
    bad[0, :3] = 10**12
    with pytest.raises(IndexError, match="outside the KV cache"):
        kernels.paged_decode_attention(query, keys, values, bad, lengths, 0.125,
                                       slot_rows=slot_rows, starts=starts)


@pytest.mark.parametrize("num_prompts", [3, 7])     # one SDPA call / per-KV-head matmuls
def test_torch_decode_paths_without_the_kernel(tiny_models, monkeypatch, num_prompts):
    """Where no native kernel serves (no compiler, a GPU), decode attention falls back
    to torch: both of its paths still give transformers' greedy tokens."""
    from engine import GenerationConfig, load_model
    from engine.kernels import build
    from tests.helpers import random_prompts, reference_greedy

    # as without a compiler: no kernels for this process's level
    monkeypatch.setattr(build, "_default", {os.environ.get("KVSERVE_CPU_ISA"): None})
    path, reference = tiny_models["qwen3"]
    model = load_model(path, progress=False)
    prompts = random_prompts(num_prompts, 5, 30, seed=num_prompts)
    outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=8, eos_token_id=[]))
    assert [o.generated_tokens for o in outputs.values()] == [
        reference_greedy(reference, p, 8) for p in prompts]


@pytest.mark.parametrize("dim", [64, 128, 48, 10, 16, 24])
def test_bf16_cache_reads_as_its_fp32_values(kernels, dim):
    """A bf16 cache (dtype bf16-weights) gives what the fp32 cache holding the same
    rounded values gives: only the storage is narrower. Head sizes of a multiple of 32
    take bf16 dot products with queries and probabilities as two bf16 halves (~16
    significant bits): within ~1e-5 of fp32 arithmetic, where dropping the low halves
    would be off by ~1e-3; other sizes are fp32 arithmetic to the last bit."""
    generator = torch.Generator().manual_seed(dim)
    keys = torch.randn(300, 3, dim, generator=generator).bfloat16()
    values = torch.randn(300, 3, dim, generator=generator).bfloat16()
    query = torch.randn(4, 9, dim, generator=generator)
    slots = torch.randperm(300, generator=generator)[:4 * 70].view(4, 70)
    lengths = torch.tensor([70, 1, 40, 17])
    got = kernels.paged_decode_attention(query, keys, values, slots, lengths, 0.1)
    widened = kernels.paged_decode_attention(query, keys.float(), values.float(), slots, lengths,
                                             0.1)
    exact = 1e-6 if dim % 32 else 3e-5
    torch.testing.assert_close(got, widened, rtol=exact, atol=exact)
    torch.testing.assert_close(got, reference(query, keys.float(), values.float(), slots,
                                              lengths, 0.1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_prompts", [3, 7])     # one SDPA call / per-KV-head matmuls
def test_torch_decode_paths_widen_a_bf16_cache(tiny_models, monkeypatch, num_prompts):
    """Without the kernel, a bf16 cache under fp32 activations is widened after the
    gather: the torch paths give the kernel's logprobs up to fp32 rounding, where bf16
    arithmetic would be off by ~1e-2."""
    from engine import ContinuousBatchingConfig, GenerationConfig, load_model
    from engine.kernels import build
    from tests.helpers import random_prompts

    path, _ = tiny_models["llama"]
    model = load_model(path, progress=False, kv_cache_dtype="bfloat16")
    prompts = random_prompts(num_prompts, 5, 30, seed=num_prompts)
    config = GenerationConfig(max_new_tokens=6, eos_token_id=[])
    with_logprobs = ContinuousBatchingConfig(return_logprobs=True)
    native = [o.logprobs for o in model.generate_batch(prompts, config, with_logprobs).values()]
    # as without a compiler: no kernels for this process's level
    monkeypatch.setattr(build, "_default", {os.environ.get("KVSERVE_CPU_ISA"): None})
    fallback = [o.logprobs for o in model.generate_batch(prompts, config,
                                                         with_logprobs).values()]
    for a, b in zip(native, fallback):
        assert a == pytest.approx(b, abs=2e-5)


def test_the_vector_passes_serve_the_head_sizes_of_this_cpu(kernels):
    """AVX-512 builds take head sizes that are multiples of 16, AVX2 builds multiples
    of 8 (both up to 256); other levels, and other sizes, run the scalar loops."""
    lanes = {"avx512": 16, "avx_vnni": 8, "avx2": 8}.get(kernels.isa, 0)
    for dim in (8, 10, 16, 24, 64, 96, 128, 256, 264):
        want = lanes > 0 and dim % lanes == 0 and dim <= 256
        assert kernels.vector_attention(dim) == want, dim

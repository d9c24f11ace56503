"""The native prefill kernel (kernels/prefill_attention.c, fronted by
attention/native_prefill.py): one chunk's causal attention over a bf16 cache against
float64 attention over the same cache values, through the shapes its tiles, key
blocks and masks meet; and whole steps through it against the SDPA path they replace."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engine.attention.torch_backend as torch_backend
from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.attention.metadata import PrefillSlice
from engine.attention.native_prefill import attend_chunk, prefill_kernels
from engine.kernels import default_kernels

kernels = default_kernels()
needs_kernel = pytest.mark.skipif(
    kernels is None or not kernels.library.prefill_attention_apply(64),
    reason="needs the native kernels built with AVX512-BF16")


def _reference(query, keys, values, slots, first_key, start, window, scale):
    """float64 attention of query [n, H, D] at positions start.. over the keys at
    positions first_key.. (slots), GQA, causal, the window if any."""
    n, heads, _ = query.shape
    group = heads // keys.shape[1]
    k = keys[slots].double().repeat_interleave(group, dim=1)       # [L, H, D]
    v = values[slots].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), k) * scale
    query_pos = torch.arange(start, start + n)[:, None]
    key_pos = torch.arange(first_key, first_key + len(slots))[None, :]
    seen = key_pos <= query_pos
    if window:
        seen &= key_pos > query_pos - window
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


CASES = [  # n, start, heads, kv_heads, dim, window
    (1, 0, 2, 1, 32, 0),            # one query, one key
    (40, 0, 9, 3, 64, 0),           # the default model's heads; a partial tile and block
    (100, 27, 9, 3, 64, 0),         # a chunk after cached tokens
    (77, 0, 4, 4, 32, 0),           # no grouping
    (50, 300, 8, 2, 128, 64),       # a window that dropped the oldest keys
    (64, 0, 4, 1, 256, 16),         # a window inside the chunk, the widest head
    (33, 5, 6, 2, 96, 0),           # a head of three 32-wide pieces
    (130, 0, 3, 3, 64, 31),         # a window that is no multiple of the key block
    (17, 400, 8, 8, 64, 100),
    (30, 0, 4, 2, 64, 40),          # a window the chunk fits in: its own slots, no kv_slots
]


def _case(n, start, heads, kv_heads, dim, window):
    """Caches, queries, chunk and metadata as a step hands them to attend_chunk; the
    chunk at rows 2 .. 2 + n of a step with rows of other requests around it."""
    generator = torch.Generator().manual_seed(n * 7 + start)
    end = start + n
    first_key = max(0, start - window + 1) if window else 0
    num_slots = end + 29
    keys = torch.randn(num_slots, kv_heads, dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(num_slots, kv_heads, dim, generator=generator).to(torch.bfloat16)
    slots = torch.randperm(num_slots, generator=generator)[:end - first_key]  # scattered pages
    # queries as the layer hands them over: the q part of fused qkv rows (strided)
    qkv = 3 * torch.randn(n + 3, (heads + 2 * kv_heads) * dim, generator=generator)
    query = qkv[:, :heads * dim].view(n + 3, heads, dim)
    own_slots = start == 0 and (not window or n <= window)     # as torch_metadata._prefill_slice
    chunk = PrefillSlice(2, 2 + n, start, None if own_slots else slots, None)
    step_slots = torch.cat([torch.tensor([0, 1]), slots, torch.tensor([2, 3, 4])]) \
        if own_slots else torch.zeros(n + 5, dtype=torch.long)
    meta = SimpleNamespace(slot_mapping=step_slots, window=window or None)
    return keys, values, slots, first_key, query, chunk, meta


def _attend(case, scale):
    keys, values, _, _, query, chunk, meta = case
    output = torch.full(query.shape, float("nan"))
    attend_chunk(kernels, query, keys, values, chunk, meta, scale, output)
    return output


@needs_kernel
@pytest.mark.parametrize("n,start,heads,kv_heads,dim,window", CASES)
def test_kernel_matches_float64_attention_over_the_cache(n, start, heads, kv_heads, dim, window):
    case = _case(n, start, heads, kv_heads, dim, window)
    keys, values, slots, first_key, query, _, _ = case
    scale = dim ** -0.5
    assert prefill_kernels(keys, values, query) is kernels
    output = _attend(case, scale)
    want = _reference(query[2:2 + n], keys, values, slots, first_key, start, window, scale)
    got = output[2:2 + n].double()
    # bf16 queries and probabilities: ~3e-3 of the largest output; a wrong mask, a
    # lost key block or a stale rescale is off by 0.1 or more
    assert (got - want).abs().max() <= 1.5e-2 * want.abs().max()
    assert (got - want).norm() <= 5e-3 * want.norm()
    assert output[:2].isnan().all() and output[2 + n:].isnan().all()   # other rows untouched


@needs_kernel
def test_any_split_between_threads_gives_the_same_bits():
    """Each tile is one thread's from start to end: one part, three (more than the
    cores), or torch's OpenMP team (large steps) give bit-identical outputs."""
    case = _case(100, 27, 9, 3, 64, 0)
    rows = slice(2, 102)                        # the chunk's (the others stay NaN)
    default = _attend(case, 0.125)[rows]
    saved = kernels.num_threads
    try:
        for parts in (1, 3):
            kernels.num_threads = parts
            assert torch.equal(_attend(case, 0.125)[rows], default)
        kernels.set_torch_threaded(True)
        assert torch.equal(_attend(case, 0.125)[rows], default)
    finally:
        kernels.set_torch_threaded(False)
        kernels.num_threads = saved


@needs_kernel
def test_a_slot_outside_the_cache_is_refused():
    keys, values, slots, _, query, chunk, meta = _case(40, 10, 4, 2, 64, 0)
    slots[5] = keys.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        attend_chunk(kernels, query, keys, values, chunk, meta, 0.125, torch.empty(query.shape))


def test_kernel_refuses_what_it_does_not_serve():
    """On any build: fp32 caches (the exact mode), head sizes it has no path for and
    bf16 queries keep SDPA."""
    query, cache = torch.randn(4, 2, 64), torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    assert prefill_kernels(cache.float(), cache.float(), query) is None             # fp32 cache
    narrow = torch.zeros(8, 1, 48, dtype=torch.bfloat16)
    assert prefill_kernels(narrow, narrow, torch.randn(4, 2, 48)) is None           # head of 48
    assert prefill_kernels(cache, cache, query.to(torch.bfloat16)) is None          # bf16 queries


def _save(path, family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(11)
    common = dict(vocab_size=211, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "mistral":
        # a window wide enough that the test's chunks pass the per-row queries' bound
        # (torch_metadata.STEP_QUERY_MAX_PAIRS counts a windowed row's keys up to the window)
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=300))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.eval().save_pretrained(path)


@pytest.fixture(scope="module", params=["llama", "mistral"])
def bf16_cache_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-head32")
    _save(path, request.param)
    return load_model(path, progress=False, kv_cache_dtype="bfloat16")


def _generate(model, prompts, **config):
    outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=6, eos_token_id=[]),
                                   ContinuousBatchingConfig(**config))
    return [o.generated_tokens for o in outputs.values()]


@needs_kernel
def test_steps_through_the_kernel_match_the_sdpa_path(bf16_cache_model, monkeypatch):
    """Long prompts (past the per-row queries' bound), whole and in chunks that start
    after cached tokens (and, for Mistral, past its window): the kernel's logits and
    tokens are the SDPA path's over the same bf16 cache."""
    model = bf16_cache_model
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 211, (length,), generator=generator).tolist()
               for length in (300, 420, 333)]
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[4])
        return attend_chunk(*args, **kwargs)

    monkeypatch.setattr(torch_backend, "attend_chunk", counted)
    logits = model.prompt_logits(prompts[1])
    whole = _generate(model, prompts)
    chunked = _generate(model, prompts, max_batch_tokens=128)
    assert calls and any(chunk.start > 0 for chunk in calls)
    monkeypatch.setattr(torch_backend, "prefill_kernels", lambda *args: None)
    calls.clear()
    # SDPA reads a first chunk's fresh fp32 K/V, the kernel their bf16 copies in the
    # cache (as every later step does): ~1e-3 apart in these logits; a wrong mask or
    # a lost key block moves them by 0.05 or more
    torch.testing.assert_close(logits, model.prompt_logits(prompts[1]), atol=1e-2, rtol=0)
    assert whole == _generate(model, prompts)
    assert chunked == _generate(model, prompts, max_batch_tokens=128)
    assert not calls

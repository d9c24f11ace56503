"""GPU paths on a CUDA machine (skipped elsewhere): transformers' greedy tokens through
the decode fast path and its CUDA graphs; graphs replaying exactly what eager steps
compute; and, where flash-attn is installed, its kernels against the reference of
their contract (tests/engine/flash_reference.py) and the flash backend against the
torch backend. `bench/gpu_check.sh` runs these with the GPU benchmark."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import load_model
from engine.attention.flash_backend import load_flash_functions
from engine.generation_config import SamplingParams
from engine.core.requests import RequestState
from engine.step.sampling import Sampler
from tests.engine import flash_reference
from tests.helpers import generate_and_inspect, random_prompts, save_head16_llama

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_flash = pytest.mark.skipif(not torch.cuda.is_available() or load_flash_functions() is None,
                                 reason="needs a CUDA device and flash-attn")


SMALL_CACHE = dict(num_blocks=64)
"""The tests' caches stay small, whatever the GPU has free."""


@pytest.fixture(scope="module")
def head16(tmp_path_factory):
    """A tiny Llama with 16-wide heads (flash-attn serves multiples of 8)."""
    path = tmp_path_factory.mktemp("tiny-llama-head16-gpu")
    return path, save_head16_llama(path, seed=81, max_position_embeddings=1024)


@torch.inference_mode()
def greedy_on(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=reference.device)
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_cuda
def test_graphs_give_transformers_tokens_in_float32(head16):
    path, reference = head16
    gpu_reference = copy.deepcopy(reference).to("cuda")
    model = load_model(path, device="cuda", progress=False)
    prompts = random_prompts(5, 20, 60, seed=71)
    tokens, stats = generate_and_inspect(model, prompts, 12, warmup=True,
                                         auto_switch_to_flash=False, **SMALL_CACHE)
    assert stats["decode_fast_path"] == 1
    assert stats["num_decode_graphs"] > 0 and stats["num_graph_steps"] > 0
    assert tokens == [greedy_on(gpu_reference, p, 12) for p in prompts]


@needs_cuda
def test_compiled_steps_and_graphs_give_transformers_tokens(head16):
    """default_compile_level 1: compiled varlen steps, and compiled decode steps
    recorded by the graphs."""
    path, reference = head16
    gpu_reference = copy.deepcopy(reference).to("cuda")
    model = load_model(path, device="cuda", progress=False)
    prompts = random_prompts(5, 20, 60, seed=74)
    tokens, stats = generate_and_inspect(model, prompts, 12, warmup=True,
                                         auto_switch_to_flash=False, default_compile_level=1,
                                         **SMALL_CACHE)
    assert stats["num_compiled_steps"] > 0 and stats["num_graph_steps"] > 0
    assert tokens == [greedy_on(gpu_reference, p, 12) for p in prompts]


@needs_cuda
@pytest.mark.parametrize("auto_switch_to_flash", [False, True])
def test_replayed_steps_equal_eager_steps(head16, auto_switch_to_flash):
    """Four requests decode together: bucket 4, no padding, the same kernels."""
    path, _ = head16
    model = load_model(path, dtype="bfloat16", device="cuda", progress=False)
    prompts = random_prompts(4, 30, 30, seed=72)
    config = dict(auto_switch_to_flash=auto_switch_to_flash, **SMALL_CACHE)
    eager, _ = generate_and_inspect(model, prompts, 24, use_cuda_graph=False, **config)
    replayed, stats = generate_and_inspect(model, prompts, 24, warmup=True, **config)
    assert stats["num_graph_steps"] >= 23
    assert replayed == eager


@needs_flash
@pytest.mark.parametrize("window", [None, 100])
def test_flash_kernels_follow_the_reference(window):
    generator = torch.Generator(device="cuda").manual_seed(9)
    options = dict(device="cuda", dtype=torch.bfloat16, generator=generator)
    k_cache, v_cache = torch.randn(2, 8, 256, 2, 64, **options)
    table = torch.tensor([[3, 5, 0], [7, 0, 0], [1, 2, 6]], dtype=torch.int32, device="cuda")
    lengths_q, lengths_k = [1, 40, 17], [300, 200, 700]
    cu_q = torch.tensor([0, 1, 41, 58], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 500, 1200], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths_q), 8, 64, **options)
    flash = load_flash_functions()
    flash_window = (-1, -1) if window is None else (window - 1, 0)
    args = (q, k_cache, v_cache, cu_q, cu_k, max(lengths_q), max(lengths_k))
    kwargs = dict(softmax_scale=0.125, causal=True, window_size=flash_window, block_table=table)
    torch.testing.assert_close(flash.varlen(*args, **kwargs),
                               flash_reference.varlen(*args, **kwargs), atol=2e-2, rtol=2e-2)
    seq_lens = torch.tensor(lengths_k, dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=seq_lens, block_table=table, softmax_scale=0.125, causal=True,
                  window_size=flash_window)
    single = q[:3].unsqueeze(1)
    torch.testing.assert_close(flash.with_kvcache(single, k_cache, v_cache, **kwargs),
                               flash_reference.with_kvcache(single, k_cache, v_cache, **kwargs),
                               atol=2e-2, rtol=2e-2)


@needs_flash
def test_flash_backend_logits_near_the_torch_backend(head16):
    path, _ = head16
    model = load_model(path, dtype="bfloat16", device="cuda", progress=False)
    ids = random_prompts(1, 300, 300, seed=73)[0]
    want = model.prompt_logits(ids, page_size=256, backend="torch")
    got = model.prompt_logits(ids, page_size=256, backend="flash")
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@needs_cuda
def test_picks_come_back_through_their_own_copies():
    """A step's picks and logprobs reach the host through pinned copies queued at
    launch, so reading them waits for that step alone (async batching's overlap), and
    they equal the device's values."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(3, 300, device="cuda", generator=generator)
    requests = [RequestState(f"r{i}", [1, 2], 4, (), sampling=SamplingParams(top_logprobs=k),
                             want_logprobs=True) for i, k in enumerate([0, 2, 5])]
    pending = Sampler(torch.device("cuda"), seed=0).launch(logits, requests)
    assert pending.ready is not None and all(t.is_pinned() for t in pending.host)
    picks = pending.result()
    logprobs = torch.log_softmax(logits, dim=-1)
    assert picks.token_ids == logits.argmax(dim=-1).tolist()
    assert picks.logprobs == pytest.approx(logprobs.max(dim=-1).values.tolist(), abs=1e-5)
    assert picks.top_logprobs[0] is None and len(picks.top_logprobs[2]) == 5
    assert [t for t, _ in picks.top_logprobs[1]] == logprobs[1].topk(2).indices.tolist()

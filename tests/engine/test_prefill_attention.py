"""Prefill chunks as per-row queries of the native attention kernel (one call per layer
for a step's prefill chunks and decodes): transformers' greedy tokens and logits
through it, chunked prefill included; long chunks keep their SDPA calls."""

from __future__ import annotations

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.attention.torch_backend import TorchPagedAttention
from engine.attention.torch_metadata import STEP_QUERY_MAX_PAIRS, TorchMetadataBuilder
from engine.step.batch import AttentionGroups, build_step_inputs
from engine.generation_config import SamplingParams
from engine.kernels import load_native_kernels
from engine.core.requests import RequestState
from engine.core.scheduler import ScheduledBatch, ScheduledRequest
from tests.helpers import random_prompts, reference_greedy, save_head16_llama


@pytest.fixture(scope="module")
def head16(tmp_path_factory):
    """A tiny Llama whose head size (16) runs on the kernel's vector path."""
    path = tmp_path_factory.mktemp("tiny-llama-head16")
    reference = save_head16_llama(path, seed=77)
    return load_model(path, progress=False), reference


def test_greedy_tokens_and_logits_through_the_one_call_path(head16, monkeypatch):
    model, reference = head16
    kernels = load_native_kernels()

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a short prefill chunk took the SDPA path")

    if kernels is not None and kernels.vector_attention(16):
        # where the kernel's vector path serves (AVX-512 builds); elsewhere the chunks
        # take SDPA and must give the same tokens and logits
        monkeypatch.setattr(TorchPagedAttention, "_prefill", staticmethod(no_sdpa))
    prompts = random_prompts(5, 6, 40, seed=5)
    # 24-token steps: prompts split into chunks that start past position 0 and share
    # steps with other requests' decodes
    chunked = ContinuousBatchingConfig(max_batch_tokens=24)
    outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=10, eos_token_id=[]),
                                   chunked)
    assert [o.generated_tokens for o in outputs.values()] == [
        reference_greedy(reference, p, 10) for p in prompts]
    ids = prompts[1]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.prompt_logits(ids), want, atol=1e-5, rtol=1e-4)


def _batch(lengths: list[int]) -> ScheduledBatch:
    entries = []
    for index, length in enumerate(lengths):
        request = RequestState(f"r{index}", [5] * length, 4, (), SamplingParams())
        request.block_ids = list(range(index * 40, index * 40 + 40))
        entries.append(ScheduledRequest(request, 0, length, True))
    return ScheduledBatch(entries, [])


QUERIES_16 = TorchMetadataBuilder(16, step_queries=True)


def test_long_chunks_keep_sdpa_and_short_ones_share_one_call():
    cpu = torch.device("cpu")
    short = build_step_inputs(_batch([20, 7, 33]), cpu, QUERIES_16).meta
    assert short.step_slot_rows.tolist() == [0] * 20 + [1] * 7 + [2] * 33
    assert short.step_lengths.tolist() == (list(range(1, 21)) + list(range(1, 8))
                                           + list(range(1, 34)))
    assert short.step_kv_slots.shape == (3, 33)
    long_prompt = int((2 * STEP_QUERY_MAX_PAIRS) ** 0.5) + 1       # its pairs pass the bound
    assert build_step_inputs(_batch([long_prompt]), cpu,
                             QUERIES_16).meta.step_kv_slots is None
    assert build_step_inputs(_batch([20]), cpu,
                             TorchMetadataBuilder(16)).meta.step_kv_slots is None


def test_sliding_window_rows_read_their_windows_part():
    """The sliding group's rows: window 4, page 4. Request 0 feeds positions 10..12
    (its row holds positions 7..12: the first key of position 10 is 7), request 1
    decodes at position 5 (positions 2..5); every row reads 4 keys, from the entry
    where its own window starts. The full group keeps whole causal contexts."""
    cpu = torch.device("cpu")
    chunk = RequestState("c", [5] * 13, 4, (), SamplingParams())
    decode = RequestState("d", [5] * 6, 4, (), SamplingParams())
    chunk.block_ids, decode.block_ids = [3, 9, 4, 6], [7, 8]
    batch = ScheduledBatch([ScheduledRequest(chunk, 10, 3, True),
                            ScheduledRequest(decode, 5, 1, True)], [])
    queries = TorchMetadataBuilder(4, step_queries=True)
    meta = build_step_inputs(batch, cpu, queries, AttentionGroups(sliding_window=4)).meta
    window = meta.sliding
    slot = lambda blocks, p: blocks[p // 4] * 4 + p % 4          # noqa: E731
    assert window.step_kv_slots[0].tolist() == [slot(chunk.block_ids, p) for p in range(7, 13)]
    assert window.step_kv_slots[1, :4].tolist() == [slot(decode.block_ids, p)
                                                    for p in range(2, 6)]
    assert window.step_slot_rows.tolist() == [0, 0, 0, 1]
    assert window.step_starts.tolist() == [0, 1, 2, 0]
    assert window.step_lengths.tolist() == [4, 4, 4, 4]
    assert meta.step_starts is None and meta.step_lengths.tolist() == [11, 12, 13, 6]
    wide = build_step_inputs(batch, cpu, queries,
                             AttentionGroups(sliding_window=64)).meta.sliding
    assert wide.step_starts.tolist() == [0, 0, 0, 0]      # a window past every position
    assert wide.step_lengths.tolist() == [11, 12, 13, 6]

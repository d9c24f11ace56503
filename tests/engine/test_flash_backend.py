"""The flash attention backend's plumbing, driven on CPU by a reference implementation
of flash-attn's paged contract (tests/engine/flash_reference.py): transformers'
greedy tokens through chunked prefill, prefix-cache hits, the decode fast path and
its varlen fallback, and sliding windows; the block tables the engine builds; where
`choose_backend` picks the backend. tests/engine/test_gpu_paths.py runs
the real kernels where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention import backend as attention_backend
from engine.attention.backend import choose_backend, get_backend
from engine.attention.flash_backend import FlashPagedAttention, flash_unsupported_reason
from engine.attention.metadata import FixedTableMetadata, FlashMetadata, TorchMetadata
from engine.attention.flash_backend import FlashMetadataBuilder
from engine.attention.torch_metadata import TorchMetadataBuilder
from engine.step.batch import AttentionGroups, FastPathBuilder, build_step_inputs
from engine.step.decode_tables import DecodeTables
from engine.generation_config import SamplingParams
from engine.core.requests import RequestState
from engine.core.scheduler import ScheduledBatch, ScheduledRequest
from tests.engine.flash_reference import CountingFunctions
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy

PAGE = 256


def generate_through_flash(model, prompts, max_new_tokens, **config):
    """generate_and_inspect with the engine choosing the flash backend on the reference
    functions (CPU has no flash-attn); returns (tokens, stats, calls per entry point)."""
    counting = CountingFunctions()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_backend, "choose_backend",
                      lambda *args: FlashPagedAttention(counting.functions()))
        tokens, stats = generate_and_inspect(model, prompts, max_new_tokens, page_size=PAGE,
                                             **config)
    return tokens, stats, counting.calls


def test_chunked_prefill_and_decode_fast_path_match_transformers(tiny_llama):
    model, reference = tiny_llama
    prompts = random_prompts(3, 250, 300, seed=41)
    # 256-token steps: prompts past one page are prefilled in chunks that start at
    # position 256 and share steps with other requests' decodes
    tokens, stats, calls = generate_through_flash(model, prompts, 6, max_batch_tokens=256,
                                                  max_blocks_per_request=2)
    assert tokens == [reference_greedy(reference, p, 6) for p in prompts]
    assert stats["decode_fast_path"] == 1
    assert calls["varlen"] > 0 and calls["with_kvcache"] > 0


def test_decodes_wider_than_the_fast_path_take_varlen(tiny_llama):
    model, reference = tiny_llama
    prompts = random_prompts(2, 260, 280, seed=42)
    tokens, _, calls = generate_through_flash(model, prompts, 4, max_blocks_per_request=1)
    assert tokens == [reference_greedy(reference, p, 4) for p in prompts]
    assert calls["with_kvcache"] == 0


def test_prefix_cache_hit_resumes_through_the_block_table(tiny_llama):
    model, reference = tiny_llama
    shared = random_prompts(1, PAGE + 10, PAGE + 10, seed=43)[0]
    prompts = [shared + tail for tail in random_prompts(2, 5, 9, seed=44)]
    tokens, stats, _ = generate_through_flash(model, prompts, 5, max_batch_tokens=PAGE)
    assert tokens == [reference_greedy(reference, p, 5) for p in prompts]
    assert stats["num_cached_blocks"] >= 1


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_mistral"])
def test_sliding_windows_match_transformers(request, name):
    model, reference = request.getfixturevalue(name)
    prompts = random_prompts(2, 270, 300, seed=45)
    tokens, stats, calls = generate_through_flash(model, prompts, 5, max_batch_tokens=PAGE)
    assert tokens == [reference_greedy(reference, p, 5) for p in prompts]
    assert stats["decode_fast_path"] == 0 and calls["varlen"] > 0


def _request(name: str, blocks: list[int | None], length: int) -> RequestState:
    request = RequestState(name, [5] * length, 4, (), SamplingParams())
    request.block_ids = blocks
    return request


def test_block_tables_pad_to_the_widest_request_or_the_fast_path_width():
    cpu = torch.device("cpu")
    decodes = ScheduledBatch([ScheduledRequest(_request("a", [7, 2], 300), 299, 1, True),
                              ScheduledRequest(_request("b", [4], 10), 9, 1, True)], [])
    flash, varlen = FlashMetadataBuilder(PAGE), TorchMetadataBuilder(PAGE)
    backends = {flash: FlashPagedAttention(CountingFunctions().functions()),
                varlen: get_backend("torch")}

    def fast_path(builder, tables):
        return FastPathBuilder(builder, tables, PAGE, backends[builder], torch.float32)
    meta = build_step_inputs(decodes, cpu, flash).meta
    assert meta.block_table.tolist() == [[7, 2], [4, 0]]
    assert meta.block_table.dtype == meta.cu_seqlens_k.dtype == torch.int32
    assert meta.cu_seqlens_k.tolist() == [0, 300, 310]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.decode_fast_path) == (1, 300, False)
    assert isinstance(meta, FlashMetadata)           # the torch backend's gathers: not built
    fast = build_step_inputs(decodes, cpu, fast_path(flash, DecodeTables(4))).meta
    assert fast.decode_fast_path and fast.block_table.tolist() == [[7, 2, 0, 0], [4, 0, 0, 0]]
    too_narrow = build_step_inputs(decodes, cpu, fast_path(flash, DecodeTables(1)))
    assert not too_narrow.meta.decode_fast_path
    rounded = build_step_inputs(decodes, cpu,
                                fast_path(varlen, DecodeTables(8, round_up=True)))
    assert rounded.meta.block_table.tolist() == [[7, 2], [4, 0]]      # 2 blocks: width 2
    assert isinstance(rounded.meta, FixedTableMetadata) and rounded.meta.decode_fast_path
    capped = DecodeTables(8, round_up=True, max_keys=2 * 2 * PAGE - 1)
    assert not build_step_inputs(decodes, cpu, fast_path(varlen, capped)).meta.decode_fast_path
    chunk = _request("c", [3, 5, 9], 600)
    chunk.sliding_block_ids = [None, 5, 9]               # block 3 fell out of the window
    mixed = ScheduledBatch([ScheduledRequest(chunk, 520, 16, True), decodes.entries[1]], [])
    groups = AttentionGroups(sliding_window=7,
                             sliding_blocks=lambda r: r.sliding_block_ids or r.block_ids)
    meta = build_step_inputs(mixed, cpu, fast_path(flash, DecodeTables(4)), groups).meta
    assert not meta.decode_fast_path                     # a prefill chunk: varlen
    assert meta.block_table.tolist() == [[3, 5, 9], [4, 0, 0]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (16, 536)
    assert meta.sliding.block_table.tolist() == [[0, 5, 9], [4, 0, 0]]   # released -> 0
    assert isinstance(build_step_inputs(decodes, cpu, varlen).meta, TorchMetadata)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("decode_only", [True, False])
def test_one_layer_equals_the_torch_backend(window, decode_only):
    """Random pages and queries through both backends: the fast path's lengths, the
    varlen path's causal offsets and windows must give the torch backend's output."""
    generator = torch.Generator().manual_seed(7)
    entries = [ScheduledRequest(_request("a", [4, 1], 300), 299, 1, True),
               ScheduledRequest(_request("b", [2], 10), 9, 1, True)]
    if not decode_only:
        entries.append(ScheduledRequest(_request("c", [0, 3, 5], 600), 520, 16, True))
    batch = ScheduledBatch(entries, [])
    cpu = torch.device("cpu")
    def group(inputs):
        return inputs.meta if window is None else inputs.meta.sliding

    groups = AttentionGroups(full_layers=window is None, sliding_window=window)
    inputs = build_step_inputs(batch, cpu,
                               FastPathBuilder(FlashMetadataBuilder(PAGE), DecodeTables(3), PAGE,
                                               FlashPagedAttention(CountingFunctions().functions()),
                                               torch.float32),
                               groups)
    meta = group(inputs)
    assert meta.decode_fast_path == decode_only
    torch_meta = group(build_step_inputs(batch, cpu, TorchMetadataBuilder(PAGE),
                                         groups))   # its own gathers
    rows = inputs.input_ids.numel()
    query = torch.randn(rows, 6, 16, generator=generator)
    key, value = torch.randn(2, rows, 2, 16, generator=generator)
    cache = torch.randn(2, 6, PAGE, 2, 16, generator=generator)
    flash_cache = cache.clone()
    want = get_backend("torch").forward(query, key, value, cache[0], cache[1], torch_meta, 0.25)
    got = FlashPagedAttention(CountingFunctions().functions()).forward(
        query, key, value, flash_cache[0], flash_cache[1], meta, 0.25)
    torch.testing.assert_close(flash_cache, cache)            # the same slots written
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_choice_on_this_host(tiny_llama):
    model, _ = tiny_llama
    assert choose_backend(model.module, True, PAGE).name == "torch"
    cuda = torch.device("cuda")
    assert "CUDA" in flash_unsupported_reason(torch.device("cpu"), torch.bfloat16, PAGE)
    assert "float16 or bfloat16" in flash_unsupported_reason(cuda, torch.float32, PAGE)
    assert "multiple of 256" in flash_unsupported_reason(cuda, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="available: 'torch', 'flash'"):
        get_backend("xformers")


def test_flash_backend_refuses_steps_without_block_tables(tiny_llama):
    model, _ = tiny_llama
    backend = FlashPagedAttention(CountingFunctions().functions())
    meta = build_step_inputs(ScheduledBatch([ScheduledRequest(_request("a", [1], 3), 0, 3, True)],
                                            []), torch.device("cpu"),
                             TorchMetadataBuilder(PAGE)).meta
    q = torch.zeros(3, 6, 10)
    cache = torch.zeros(2, PAGE, 2, 10)
    with pytest.raises(TypeError, match="reads block tables .* got TorchMetadata"):
        backend.forward(q, q[:, :2], q[:, :2], cache, cache, meta, 1.0)

"""Decode CUDA graphs' padding and bucket logic (engine/step/cuda_graphs.py), run eagerly on
CPU with the flash backend on a reference of its kernels: padded static-buffer steps
give the plain steps' tokens and leave every request's pages as the plain steps do
(padding rows write only to the scratch page). tests/engine/test_gpu_paths.py records
and replays real graphs where there is a GPU."""

from __future__ import annotations


import pytest
import torch

from engine import ContinuousBatchingConfig
from engine.attention.backend import get_backend
from engine.attention.fixed_table_decode import fixed_table_decode, table_gather
from engine.attention.metadata import FixedTableMetadata
from engine.attention.flash_backend import FlashPagedAttention
from engine.step.batch import FastPathBuilder
from engine.step.compile_paths import CompilePlan, CompileSettings
from engine.step.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.step.decode_tables import DecodeTables, decode_tables_for
from engine.step.feature_gates import decode_graphs
from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.paged_cache import PagedKVCache
from engine.kv_cache.sizing import CacheSizing
from engine.core.requests import RequestState
from engine.step.runner import ModelRunner
from engine.core.scheduler import ScheduledBatch, ScheduledRequest
from tests.engine.flash_reference import CountingFunctions, with_kvcache
from tests.helpers import needs_torch_at_cpu_level, random_prompts

PAGE = 256
NUM_BLOCKS = 7


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(11) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(10, interval=4) == [4, 8, 12]
    with pytest.raises(ValueError, match="max_requests"):
        graph_batch_sizes(0)


def test_table_widths_follow_the_kernel_that_reads_them():
    flash = decode_tables_for(True, 8, PAGE, 0, bytes_per_key=768)
    assert flash.widths() == [8] and flash.width_for(3, 64, PAGE) == 8
    torch_tables = decode_tables_for(False, 8, PAGE, 0, bytes_per_key=768)
    assert torch_tables.widths() == [1, 2, 4, 8]
    assert torch_tables.width_for(3, 2, PAGE) == 4 and torch_tables.width_for(9, 1, PAGE) is None
    # the gather cap: 1 GiB of K and V at 768 bytes a key
    assert torch_tables.max_keys == (1 << 30) // 768
    assert torch_tables.width_for(8, 1000, PAGE) is None
    stepped = decode_tables_for(False, 8, PAGE, kv_padding_interval_size=700, bytes_per_key=768)
    assert stepped.widths() == [3, 6, 8]                       # ceil(700 / 256) = 3 blocks
    assert DecodeTables(5, round_up=True).widths() == [1, 2, 4, 5]
    with pytest.raises(ValueError):
        DecodeTables(0)


@pytest.mark.parametrize("tables", [
    DecodeTables(8),                                              # flash: one width
    DecodeTables(8, round_up=True, max_keys=32 * PAGE),           # torch: capped gather
], ids=["flash", "torch-capped"])
def test_graphs_are_recorded_for_the_pairs_steps_reach(tables):
    """capture_all records (bucket, width) for exactly the pairs some decode step can
    replay: a capped table policy never gives wide tables to large batches, so their
    graphs (the biggest recordings) would be dead memory."""
    cache = PagedKVCache(num_layers=1, num_blocks=NUM_BLOCKS, page_size=PAGE, num_kv_heads=1,
                         head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    graphs = DecodeGraphs(torch.nn.Identity(), cache, max_requests=16, tables=tables,
                          scratch_block=NUM_BLOCKS - 1, capture=False)
    reached = set()
    for num_requests in range(1, 17):
        bucket = next(size for size in graphs.sizes if size >= num_requests)
        for widest in range(1, tables.max_width + 1):
            width = tables.width_for(widest, num_requests, PAGE)
            if width is not None:
                reached.add((bucket, width))
    pairs = graphs.reachable_pairs()
    assert set(pairs) == reached and len(pairs) == len(reached)
    assert pairs == sorted(pairs, key=lambda pair: (pair[1], pair[0]), reverse=True)
    if tables.round_up:    # 32 blocks of keys: width 8 up to 4 requests, width 4 up to 8
        assert (4, 8) in pairs and (8, 8) not in pairs and (16, 4) not in pairs
    else:
        assert pairs == [(16, 8), (8, 8), (4, 8), (2, 8), (1, 8)]


def test_graphs_only_where_they_work():
    auto = ContinuousBatchingConfig()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_graphs(auto, True, cuda, False) == "capture"
    assert decode_graphs(ContinuousBatchingConfig(use_cuda_graph=(True, True)), True, cuda,
                         False) == "capture"
    assert decode_graphs(ContinuousBatchingConfig(use_cuda_graph=(True, False)), True, cuda,
                         False) is None
    assert decode_graphs(ContinuousBatchingConfig(use_cuda_graph=False), True, cuda, False) is None
    assert decode_graphs(auto, True, cpu, False) is None
    assert decode_graphs(auto, False, cuda, False) is None       # no decode fast path
    assert decode_graphs(auto, True, cuda, True) is None         # tensor parallel


@pytest.mark.parametrize("window", [None, 30])
def test_fixed_table_decode_follows_the_kvcache_contract(window):
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 6, PAGE, 2, 16, generator=generator)
    query = torch.randn(3, 6, 16, generator=generator)
    seq_lens = torch.tensor([300, 10, 512], dtype=torch.int32)
    table = torch.tensor([[4, 1], [2, 0], [5, 3]], dtype=torch.int32)
    flash_window = (-1, -1) if window is None else (window - 1, 0)
    want = with_kvcache(query.unsqueeze(1), cache[0], cache[1], cache_seqlens=seq_lens,
                        block_table=table, softmax_scale=0.25, causal=True,
                        window_size=flash_window).squeeze(1)
    got = fixed_table_decode(query, cache[0], cache[1], seq_lens, table, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a step's gather, built once and passed to each layer, gives the same result
    gather = table_gather(seq_lens, table, PAGE, torch.float32, window)
    assert gather.mask.shape == (3, 1, 1, 2 * PAGE) and gather.mask.dtype == torch.float32
    assert (gather.mask == 0).sum(-1).flatten().tolist() == (
        [300, 10, 512] if window is None else [30, 10, 30])
    assert set(gather.mask.unique().tolist()) == {0.0, float("-inf")}
    torch.testing.assert_close(
        fixed_table_decode(query, cache[0], cache[1], seq_lens, table, 0.25, window, gather),
        got, atol=0, rtol=0)


def test_fast_path_steps_carry_their_backends_gather():
    """The fast path's metadata is built whole per step: the torch backend's gather
    indices and mask come with the tables (every layer reads the same ones), and the
    flash backend, which reads the tables itself, gets none."""
    requests = []
    allocator = BlockAllocator(NUM_BLOCKS)
    for index, length in enumerate((5, 300)):
        request = RequestState(f"r{index}", [3] * length, 4, (), SamplingParams())
        request.block_ids = allocator.allocate(2)
        requests.append(request)
    batch = _decode_step(requests)
    for backend in (get_backend("torch"), FlashPagedAttention(CountingFunctions().functions())):
        builder = FastPathBuilder(backend.metadata_builder(PAGE), DecodeTables(2), PAGE,
                                  backend, torch.float32)
        meta = builder.build(batch, None, lambda r: r.block_ids, torch.device("cpu"))
        assert isinstance(meta, FixedTableMetadata)
        if backend.name == "flash":
            assert meta.gather is None
            continue
        want = table_gather(meta.seq_lens_k, meta.block_table, PAGE, torch.float32)
        assert torch.equal(meta.gather.blocks, want.blocks)
        assert torch.equal(meta.gather.mask, want.mask)
        assert meta.gather.mask[0, 0, 0, :5].eq(0).all() and meta.gather.mask[0, 0, 0, 5:].eq(
            float("-inf")).all()


def _decode_step(requests: list[RequestState]) -> ScheduledBatch:
    return ScheduledBatch([ScheduledRequest(r, r.num_tokens - 1, 1, True) for r in requests], [])


@pytest.mark.parametrize("backend", ["flash", "torch", pytest.param(
    "torch-compiled", marks=needs_torch_at_cpu_level)])
def test_padded_steps_equal_plain_steps(tiny_llama, backend):
    """The flash backend (on the reference of its kernels) and the torch backend's
    fixed-width decode, which accelerators without flash-attn replay; and that one
    through the decode path's compiled layer step (inductor), as graphs record it."""
    model, _ = tiny_llama
    module = model.module
    attention = (FlashPagedAttention(CountingFunctions().functions())
                 if backend == "flash" else get_backend("torch"))
    compiled = CompilePlan(decode=CompileSettings(dynamic=True)) if "compiled" in backend else None
    sizing = CacheSizing(NUM_BLOCKS, PAGE, 512, 11, 0)
    tables = DecodeTables(3, round_up=backend != "flash")
    plain = ModelRunner(module, sizing, seed=0, decode_tables=tables, backend=attention)
    padded = ModelRunner(module, sizing, seed=0, decode_tables=tables, decode_graphs="eager",
                         compile_plan=compiled, backend=attention)
    assert padded.cache.key_caches[0].shape[0] == NUM_BLOCKS + 1     # the scratch page
    assert padded.decode_graphs.sizes == [1, 2, 4, 8, 16]
    for runner in (plain, padded):                # the same start, NaN-free pages
        for cache in runner.cache.key_caches + runner.cache.value_caches:
            cache.zero_()
    allocator = BlockAllocator(NUM_BLOCKS)
    requests = []
    for index, prompt in enumerate(random_prompts(3, 260, 300, seed=51)):
        request = RequestState(f"r{index}", prompt, 8, (), SamplingParams())
        request.block_ids = allocator.allocate(2)
        requests.append(request)
    prefill = ScheduledBatch([ScheduledRequest(r, 0, r.num_tokens, True) for r in requests], [])
    for step in range(6):
        live = requests if step < 4 else requests[:2]    # 3 rows pad to 4, then 2 fit 2
        batch = prefill if step == 0 else _decode_step(live)
        (_, want), (_, got) = plain.step(batch), padded.step(batch)
        assert got.token_ids == want.token_ids
        for name in ("key_caches", "value_caches"):
            for ours, theirs in zip(getattr(padded.cache, name), getattr(plain.cache, name)):
                torch.testing.assert_close(ours[:NUM_BLOCKS], theirs)
        for request, token in zip(batch.entries, want.token_ids):
            request.request.generated_tokens.append(token)
    assert padded.decode_graphs.num_steps == 5
    if compiled:             # every layer of the five decode steps ran compiled
        assert padded.decode_step.num_calls == 5 * len(module.layers)


def test_graphs_serve_only_the_steps_they_were_built_for(tiny_llama):
    model, _ = tiny_llama
    sizing = CacheSizing(NUM_BLOCKS, PAGE, 512, 3, 0)
    runner = ModelRunner(model.module, sizing, seed=0,
                         decode_tables=DecodeTables(4, round_up=True), decode_graphs="eager")
    graphs = runner.decode_graphs
    assert graphs.sizes == [1, 2, 4] and graphs.widths == [1, 2, 4]
    assert graphs.capture_all() == 0                      # eager: nothing to record
    requests = []
    for index, blocks in enumerate(([0, 1], [2], [3], [4])):
        request = RequestState(f"r{index}", [5] * (PAGE * len(blocks) - 3), 8, (), SamplingParams())
        request.block_ids = blocks
        requests.append(request)
    step = runner._inputs(_decode_step(requests[:3]))
    assert step.meta.block_table.shape == (3, 2) and graphs.fits(step.meta, 3)
    four = runner._inputs(_decode_step(requests))
    assert graphs.fits(four.meta, 4)                      # the largest bucket holds 4
    assert not graphs.fits(four.meta, 5)                  # 5 would not fit it
    prefill = runner._inputs(ScheduledBatch([ScheduledRequest(requests[0], 0, 4, True)], []))
    assert not prefill.meta.decode_fast_path and not graphs.fits(prefill.meta, 1)

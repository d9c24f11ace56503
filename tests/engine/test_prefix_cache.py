"""Prefix caching: exact block ids in the allocator, hits in the scheduler, and
identical outputs with fewer prefilled tokens in the engine."""

from engine import ContinuousBatchingConfig, GenerationConfig
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.block_hash import extend_block_hashes, hash_block
from engine.core.scheduler import Scheduler

from tests.engine.test_scheduler import make_request, run_step
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy


def test_hashes_chain_over_the_prefix():
    first = []
    extend_block_hashes(first, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(first) == 2                                # the partial third block is not hashed
    assert first[1] == hash_block(first[0], [5, 6, 7, 8])
    other = []
    extend_block_hashes(other, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert other[1] != first[1]                           # same tokens, different prefix


def test_released_blocks_stay_cached_and_are_evicted_lru():
    allocator = BlockAllocator(4, enable_caching=True)
    a = allocator.allocate(2)
    allocator.register(a[0], b"h0")
    allocator.register(a[1], b"h1")
    allocator.free(reversed(a))                        # tail first
    assert allocator.num_free_blocks == 4 and allocator.num_cached_blocks == 2
    assert allocator.lookup([b"h0", b"h1", b"h2"]) == [0, 1]
    allocator.check_invariants([])
    # never-used blocks go first, then the cached tail block 1, then block 0
    assert allocator.allocate(2) == [2, 3]
    assert allocator.allocate(1) == [1]
    assert allocator.lookup([b"h0", b"h1"]) == [0]
    allocator.share([0])                               # taken back from the cache
    assert allocator.ref_count(0) == 1 and allocator.num_free_blocks == 0
    allocator.check_invariants([[2, 3], [1], [0]])
    assert allocator.num_evictions == 1


def test_scheduler_reuses_a_cached_prefix_and_computes_the_rest():
    scheduler = Scheduler(BlockAllocator(32, enable_caching=True), 4, 64, 8, 0.0, "fifo")
    first = make_request("a", 14, max_new_tokens=5)
    scheduler.add(first)
    run_step(scheduler)
    second = make_request("b", 14, max_new_tokens=2)
    second.prompt_ids = first.prompt_ids[:12] + [99, 98]
    scheduler.add(second)
    batch = run_step(scheduler)
    entry = [e for e in batch.entries if e.request is second][0]
    assert (entry.start, entry.num_tokens) == (12, 2)        # 3 full blocks reused
    assert second.block_ids[:3] == first.block_ids[:3]
    assert scheduler.blocks.prefix_hit_tokens == 12
    # an identical prompt never reuses its last token's block: its logits are needed;
    # that block's first 3 slots are copied from the running first request instead
    third = make_request("c", 12, max_new_tokens=2)
    third.prompt_ids = first.prompt_ids[:12]
    scheduler.add(third)
    batch = run_step(scheduler)
    entry = [e for e in batch.entries if e.request is third][0]
    assert (entry.start, entry.num_tokens) == (11, 1)
    assert batch.prefix_copies == [(first.block_ids[2], third.block_ids[2], 3)]


def started_manager(model, **config):
    """A running manager generating 4 tokens a request (EOS ignored) under `config`."""
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=4, eos_token_id=[]), ContinuousBatchingConfig(**config))
    manager.start()
    return manager


def run(model, prompts, sharing, **config):
    return generate_and_inspect(model, prompts, 6, page_size=4, allow_block_sharing=sharing,
                                **config)


def test_shared_prefix_is_prefilled_once_with_identical_outputs(tiny_llama):
    model, reference = tiny_llama
    system = random_prompts(1, 40, 40, seed=11)[0]
    prompts = [system + tail for tail in random_prompts(6, 2, 9, seed=12)]
    shared, stats_on = run(model, prompts, True, num_blocks=128)
    unshared, stats_off = run(model, prompts, False, num_blocks=128)
    assert shared == unshared == [reference_greedy(reference, p, 6) for p in prompts]
    prompt_tokens = sum(len(p) for p in prompts)
    assert stats_off["num_prefill_tokens"] == prompt_tokens
    # the 40-token prefix (10 blocks) is computed once, not six times
    assert stats_on["num_prefill_tokens"] == prompt_tokens - 5 * 40
    assert stats_on["prefix_cache_hits"] == 5 * 40


def test_cached_blocks_outlive_their_owner_and_are_evicted_under_pressure(tiny_llama):
    model, reference = tiny_llama
    prompt = random_prompts(1, 33, 33, seed=13)[0]
    manager = started_manager(model, page_size=4, num_blocks=12)
    first = manager.add_request(prompt)
    assert next(r for r in manager.request_id_iter(first)).is_finished()
    assert manager.stats()["num_cached_blocks"] == 9      # 36 of 37 tokens were written
    again = manager.add_request(prompt)
    result = [r for r in manager.request_id_iter(again)][-1]
    assert result.generated_tokens == reference_greedy(reference, prompt, 4)
    assert manager.stats()["prefix_cache_hits"] == 32     # 8 blocks; the last is recomputed
    other = manager.add_request(random_prompts(1, 40, 40, seed=14)[0], max_new_tokens=4)
    [r for r in manager.request_id_iter(other)]
    assert manager.stats()["num_evictions"] > 0
    manager.stop()
    manager.check_invariants()
    manager.destroy()


def test_a_prompt_filling_its_pages_reuses_all_but_one_token(tiny_llama):
    """32 tokens in pages of 4: after the first request ends, all 8 pages are cached;
    the same prompt again takes 7 whole and copies the last one's first 3 slots (one
    token must be computed for its logits), and generates transformers' tokens."""
    model, reference = tiny_llama
    prompt = random_prompts(1, 32, 32, seed=15)[0]
    manager = started_manager(model, page_size=4, num_blocks=24)
    first = manager.add_request(prompt)
    assert next(r for r in manager.request_id_iter(first)).is_finished()
    again = manager.add_request(prompt)
    result = [r for r in manager.request_id_iter(again)][-1]
    assert result.generated_tokens == reference_greedy(reference, prompt, 4)
    assert manager.stats()["prefix_cache_hits"] == 31
    manager.stop()
    manager.check_invariants()
    stats = manager.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    manager.destroy()

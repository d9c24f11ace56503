"""Prefix sharing below a page: which running request a new one copies from, the
copies and pins the scheduler hands the runner, the slots copied in the cache, and
transformers' tokens with fewer prefilled tokens in the engine."""

import pytest
import torch

from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.block_hash import extend_block_hashes
from engine.kv_cache.paged_cache import PagedKVCache, copy_slots
from engine.kv_cache.partial_prefix import PartialPrefix, find_partial_prefix
from engine.core.requests import RequestState
from engine.core.scheduler import Scheduler

from tests.engine.test_scheduler import run_step
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy


def request(request_id: str, prompt: list[int], computed: int = 0,
            block_ids: list[int] = (), page_size: int | None = None) -> RequestState:
    """With `page_size`: with its full blocks' hashes, as admission leaves them."""
    state = RequestState(request_id, list(prompt), 4, (), SamplingParams())
    state.num_computed_tokens, state.block_ids = computed, list(block_ids)
    if page_size is not None:
        extend_block_hashes(state.block_hashes, state.prompt_ids, page_size)
    return state


def test_the_longest_computed_run_wins_and_one_token_is_left():
    system = [5, 6, 7, 8, 9, 10]
    short = request("short", system[:3] + [40, 41], computed=5, block_ids=[4])
    long = request("long", system + [42], computed=7, block_ids=[9])
    uncomputed = request("new", system + [43], computed=0, block_ids=[])
    new = request("b", system + [44, 45])
    assert find_partial_prefix(new, [short, long, uncomputed], 16) == PartialPrefix(9, 6)
    # the same prompt as a source: all but its last token
    again = request("c", system + [42])
    assert find_partial_prefix(again, [long], 16) == PartialPrefix(9, 6)
    # a source computed only part way shares only what it has computed
    long.num_computed_tokens = 4
    assert find_partial_prefix(new, [long], 16) == PartialPrefix(9, 4)
    assert find_partial_prefix(request("d", [1, 2, 3]), [short, long], 16) is None


def test_only_the_page_after_the_cached_blocks_is_looked_at():
    prefix = list(range(3, 11))                              # two full pages of 4
    source = request("a", prefix + [20, 21, 22], computed=11, block_ids=[1, 2, 3], page_size=4)
    new = request("b", prefix + [20, 21, 30, 31], page_size=4)
    new.num_computed_tokens = 8                              # the cached full pages
    assert find_partial_prefix(new, [source], 4) == PartialPrefix(3, 2)
    other_start = request("c", [99] + prefix[1:] + [20, 21, 30], page_size=4)
    other_start.num_computed_tokens = 8       # other full pages before: other hashes
    assert find_partial_prefix(other_start, [source], 4) is None


def test_scheduler_copies_pins_and_unpins():
    scheduler = Scheduler(BlockAllocator(16, enable_caching=True), 16, 64, 8, 0.0, "fifo")
    first = request("a", list(range(3, 13)))
    scheduler.add(first)
    run_step(scheduler)
    second = request("b", list(range(3, 9)) + [50, 51, 52])
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.prefix_copies == [(first.block_ids[0], second.block_ids[0], 6)]
    entry = [e for e in batch.entries if e.request is second][0]
    assert (entry.start, entry.num_tokens) == (6, 3)
    assert scheduler.allocator.ref_count(first.block_ids[0]) == 2      # held + pinned
    assert scheduler.blocks.prefix_hit_tokens == 6
    source_block = first.block_ids[0]
    scheduler.finish(first)                                  # the source goes away...
    assert scheduler.allocator.ref_count(source_block) == 1  # ...its block stays pinned
    scheduler.check_invariants()
    run_step(scheduler)
    assert scheduler.allocator.ref_count(source_block) == 0


def finish(scheduler, state):
    scheduler.add(state)
    while state.status.name != "FINISHED":
        run_step(scheduler)


def test_a_finished_requests_page_is_copied_while_its_block_is_untouched():
    scheduler = Scheduler(BlockAllocator(4, enable_caching=True), 16, 64, 8, 0.0, "fifo")
    first = request("a", list(range(3, 13)))                  # 10 tokens, 4 generated
    finish(scheduler, first)
    page = next(iter(scheduler.blocks.retained_pages.pages.values()))
    assert page.tokens == first.all_tokens()[:13]            # what its slots hold
    second = request("b", first.all_tokens()[:12] + [90, 91])    # the next turn
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.prefix_copies == [(page.block_id, second.block_ids[0], 12)]
    assert scheduler.allocator.ref_count(page.block_id) == 1        # taken off the free list
    run_step(scheduler)
    assert scheduler.allocator.is_free(page.block_id)               # and back on it


def test_a_block_given_out_again_is_no_source():
    scheduler = Scheduler(BlockAllocator(2, enable_caching=True), 16, 64, 8, 0.0, "fifo")
    first = request("a", list(range(3, 13)))
    finish(scheduler, first)
    block = next(iter(scheduler.blocks.retained_pages.pages))
    scheduler.add(request("x", [70, 71, 72]))
    scheduler.schedule()                  # `x` is given the freed block first...
    scheduler.remove("x")                 # ...and cancelled: the block is free again
    assert scheduler.allocator.is_free(block) and scheduler.allocator.times_allocated(block) == 2
    second = request("b", first.all_tokens()[:12] + [90])
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.prefix_copies == [] and batch.entries[0].start == 0
    assert not scheduler.blocks.retained_pages.pages                # forgotten


def test_two_chats_after_one_copy_from_its_page_not_from_each_other():
    scheduler = Scheduler(BlockAllocator(8, enable_caching=True), 16, 64, 8, 0.0, "fifo")
    first = request("a", list(range(3, 13)))
    finish(scheduler, first)
    block = next(iter(scheduler.blocks.retained_pages.pages))
    second, third = (request(n, list(range(3, 13)) + [t]) for n, t in (("b", 50), ("c", 60)))
    scheduler.add(second)
    scheduler.add(third)
    batch = run_step(scheduler)
    # `c` would pick `b` (its 10 tokens count as computed): it reads `b`'s source
    assert batch.prefix_copies == [(block, second.block_ids[0], 10),
                                   (block, third.block_ids[0], 10)]
    run_step(scheduler)
    assert scheduler.allocator.is_free(block)


def test_a_retained_page_never_keeps_a_request_out():
    scheduler = Scheduler(BlockAllocator(4, enable_caching=True), 16, 64, 8, 0.0, "fifo")
    first = request("a", list(range(3, 13)))
    finish(scheduler, first)
    # needs all 4 blocks: with the retained page held there would be 3
    large = request("b", list(range(3, 13)) + list(range(100, 150)))
    scheduler.add(large)
    batch = run_step(scheduler)
    assert [e.request for e in batch.entries] == [large] and batch.prefix_copies == []


def test_copy_slots_copies_the_first_slots_of_each_pair_in_every_layer():
    cache = PagedKVCache(2, 4, 8, 2, 3, torch.float32, torch.device("cpu"))
    for layer in cache.key_caches + cache.value_caches:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in cache.key_caches + cache.value_caches]
    copy_slots(cache, [(1, 3, 5), (2, 0, 2)])
    for old, new in zip(before, cache.key_caches + cache.value_caches):
        expected = old.clone()
        expected[3, :5] = old[1, :5]
        expected[0, :2] = old[2, :2]
        assert torch.equal(new, expected)


def test_the_next_turn_of_a_chat_gives_transformers_tokens(tiny_llama):
    from engine import ContinuousBatchingConfig, GenerationConfig

    model, reference = tiny_llama
    prompt = random_prompts(1, 20, 20, seed=23)[0]
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=5, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=64, num_blocks=8))
    manager.start()
    try:
        first = [r for r in manager.request_id_iter(manager.add_request(prompt))][-1]
        follow_up = prompt + first.generated_tokens + [17, 18, 19]
        second = [r for r in manager.request_id_iter(manager.add_request(follow_up))][-1]
        assert first.generated_tokens == reference_greedy(reference, prompt, 5)
        assert second.generated_tokens == reference_greedy(reference, follow_up, 5)
        assert manager.stats()["prefix_cache_hits"] == 24   # 20 + 4 computed generated
    finally:
        manager.stop()
        manager.check_invariants()
        manager.destroy()


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
def test_shared_start_of_a_page_gives_transformers_tokens(tiny_llama, scheduler_type):
    model, reference = tiny_llama
    system = random_prompts(1, 11, 11, seed=21)[0]
    prompts = [system + tail for tail in random_prompts(5, 3, 9, seed=22)]
    config = dict(page_size=32, num_blocks=64, max_batch_tokens=16,
                  scheduler_type=scheduler_type)
    shared, stats_on = generate_and_inspect(model, prompts, 6, allow_block_sharing=True,
                                            **config)
    unshared, stats_off = generate_and_inspect(model, prompts, 6, allow_block_sharing=False,
                                               **config)
    assert shared == unshared == [reference_greedy(reference, p, 6) for p in prompts]
    # a 16-token budget admits the prompts over several steps: each prompt admitted
    # after the first step finds the 11 system tokens computed by an earlier one (the
    # two admitted in the first step have nothing computed to copy from)
    assert stats_on["prefix_cache_hits"] >= 3 * 11
    assert stats_on["num_prefill_tokens"] == (stats_off["num_prefill_tokens"]
                                              - stats_on["prefix_cache_hits"])

"""CPU offload on preemption: evicted requests' K/V go to a CPU pool and come back
without recomputation; the tokens are the same as with recompute or no pressure."""

from engine.kv_cache.allocator import BlockAllocator
from engine.core.scheduler import Scheduler

from tests.engine.test_scheduler import make_request, run_step
from tests.helpers import generate_and_inspect, random_prompts, reference_greedy


def test_scheduler_swaps_out_on_preemption_and_resumes_where_it_stopped():
    scheduler = Scheduler(BlockAllocator(4), 4, 32, 8, 0.0, "fifo",
                          offload_allocator=BlockAllocator(4))
    first, second = make_request("a", 7, 10), make_request("b", 7, 10)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    run_step(scheduler)
    second_blocks = list(second.block_ids)
    batch = run_step(scheduler)                 # "a" needs a third block: "b" is evicted
    assert batch.preempted == [second]
    assert batch.swap_out == [(second_blocks, [0, 1])]
    assert second.offloaded_tokens == 8 and second.offloaded_slots == [0, 1]
    while second.status.name == "PENDING":
        batch = run_step(scheduler)
    entry = [e for e in batch.entries if e.request is second][0]
    assert batch.swap_in == [([0, 1], second.block_ids[:2])]
    assert (entry.start, entry.num_tokens) == (8, 1)      # nothing recomputed
    while scheduler.has_work():
        run_step(scheduler)
    assert len(first.generated_tokens) == len(second.generated_tokens) == 10
    scheduler.schedule()                                  # frees the last swap-in's slots
    assert scheduler.blocks.offload_allocator.num_free_blocks == 4


def run(model, prompts, **config):
    return generate_and_inspect(model, prompts, 10, page_size=4, max_batch_tokens=64,
                                allow_block_sharing=False, **config)


def test_offload_and_recompute_give_the_unconstrained_tokens(tiny_llama):
    model, reference = tiny_llama
    prompts = random_prompts(10, 5, 30, seed=21)
    prompt_tokens = sum(len(p) for p in prompts)
    expected = [reference_greedy(reference, p, 10) for p in prompts]
    free_run, free_stats = run(model, prompts, num_blocks=256)
    offload, offload_stats = run(model, prompts, num_blocks=12, cpu_offload_space=0.01)
    recompute, recompute_stats = run(model, prompts, num_blocks=12, cpu_offload_space=0)
    assert free_run == offload == recompute == expected
    assert free_stats["num_preemptions"] == 0
    assert offload_stats["num_preemptions"] > 0 and recompute_stats["num_preemptions"] > 0
    assert offload_stats["num_swapped_out"] == offload_stats["num_preemptions"]
    assert offload_stats["num_swapped_in"] == offload_stats["num_swapped_out"]
    assert offload_stats["num_prefill_tokens"] == prompt_tokens       # nothing recomputed
    assert recompute_stats["num_prefill_tokens"] > prompt_tokens
    assert recompute_stats["num_swapped_out"] == 0

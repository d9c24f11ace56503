"""Scheduler tests without torch or a model: tokens are appended by hand."""

import pytest

from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.core.requests import RequestState
from engine.core.scheduler import Scheduler


def make_request(request_id: str, prompt_len: int, max_new_tokens: int = 8) -> RequestState:
    return RequestState(request_id, list(range(3, 3 + prompt_len)), max_new_tokens, (),
                        SamplingParams())


def run_step(scheduler: Scheduler):
    """Schedule, then play the runner: mark tokens computed and sample token 7."""
    batch = scheduler.schedule()
    assert batch is not None
    for entry in batch.entries:
        entry.request.num_computed_tokens = entry.end
        if entry.samples:
            entry.request.append_token(7)
    for entry in batch.entries:
        if entry.request.status.name == "FINISHED":
            scheduler.finish(entry.request)
    scheduler.check_invariants()
    return batch


def make_scheduler(num_blocks=64, page_size=4, budget=16, max_requests=8, margin=0.0,
                   policy="fifo") -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks), page_size, budget, max_requests, margin, policy)


def test_long_prompt_is_prefilled_in_chunks_then_decodes():
    scheduler = make_scheduler(budget=16)
    request = make_request("a", 40)
    scheduler.add(request)
    chunks = [[(e.start, e.num_tokens, e.samples) for e in run_step(scheduler).entries]
              for _ in range(4)]
    assert chunks == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)], [(40, 1, True)]]
    assert request.block_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 42 tokens -> 11 pages


def test_budget_mixes_decodes_and_a_prefill_chunk_fifo():
    scheduler = make_scheduler(budget=10)
    first, second = make_request("a", 5), make_request("b", 30)
    scheduler.add(first)
    scheduler.add(second)
    batch = run_step(scheduler)
    assert [(e.request.request_id, e.num_tokens) for e in batch.entries] == [("a", 5), ("b", 5)]
    batch = run_step(scheduler)
    # "a" decodes one token, "b" takes the rest of the budget
    assert [(e.request.request_id, e.num_tokens) for e in batch.entries] == [("a", 1), ("b", 9)]


def test_prefill_first_puts_prefills_before_decodes():
    scheduler = make_scheduler(budget=10, policy="prefill_first")
    scheduler.add(make_request("a", 3))
    run_step(scheduler)                      # "a" prefilled and sampled its first token
    scheduler.add(make_request("b", 8))
    batch = run_step(scheduler)
    assert [(e.request.request_id, e.num_tokens) for e in batch.entries] == [("b", 8), ("a", 1)]
    scheduler.add(make_request("c", 30))
    batch = run_step(scheduler)             # prefills first, but each decode keeps a token
    assert [(e.request.request_id, e.num_tokens) for e in batch.entries] == \
        [("c", 8), ("a", 1), ("b", 1)]


def test_prefill_first_arrivals_never_starve_decodes():
    scheduler = make_scheduler(budget=64, max_requests=2, policy="prefill_first")
    scheduler.add(make_request("a", 3, max_new_tokens=6))
    run_step(scheduler)
    for index in range(4):                  # a queue of prompts waiting to start
        scheduler.add(make_request(f"new{index}", 5, max_new_tokens=4))
    while scheduler.has_work():
        decoding = [r for r in scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1]
        batch = run_step(scheduler)
        # every request already decoding gets its token: admissions wait for room
        assert set(decoding) <= {e.request for e in batch.entries}


def test_max_requests_per_batch_caps_entries():
    scheduler = make_scheduler(budget=100, max_requests=2)
    for name in "abc":
        scheduler.add(make_request(name, 2))
    batch = run_step(scheduler)
    assert [e.request.request_id for e in batch.entries] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_safety_margin_holds_back_new_prefills_while_others_run():
    scheduler = make_scheduler(num_blocks=10, budget=100, margin=0.5)
    scheduler.add(make_request("a", 16))     # 4 blocks, nothing running: admitted
    scheduler.add(make_request("b", 8))      # would leave 4 of 10 free < 5: held back
    batch = run_step(scheduler)
    assert [e.request.request_id for e in batch.entries] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_preemption_frees_the_newest_request_and_keeps_its_tokens():
    scheduler = make_scheduler(num_blocks=4, page_size=4, budget=32)
    first, second = make_request("a", 7, 10), make_request("b", 7, 10)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)                      # both prefilled: 2 blocks each, cache full
    assert scheduler.allocator.num_free_blocks == 0
    run_step(scheduler)                      # position 7 still fits in the second page
    batch = run_step(scheduler)              # "a" needs a 3rd block for position 8: "b" yields
    assert batch.preempted == [second]
    assert second.num_computed_tokens == 0 and second.generated_tokens == [7, 7]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    for _ in range(40):
        if not scheduler.has_work():
            break
        run_step(scheduler)
    assert len(first.generated_tokens) == 10 and len(second.generated_tokens) == 10
    assert scheduler.allocator.num_free_blocks == 4


def test_remove_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add(make_request("a", 6))
    scheduler.add(make_request("b", 6))
    run_step(scheduler)
    scheduler.add(make_request("c", 6))
    assert scheduler.remove("a").request_id == "a"
    assert scheduler.remove("c").request_id == "c"
    assert scheduler.remove("missing") is None
    scheduler.allocator.check_invariants([r.block_ids for r in scheduler.running])
    assert scheduler.allocator.num_free_blocks == 6


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        make_scheduler(policy="lifo")

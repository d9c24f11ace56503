"""Randomised scheduling: many requests of random lengths, random cancellations and
both policies on a tiny cache (so preemption, chunking and prefix hits all happen).
After every step the allocator invariants hold, and a shadow cache that plays the
runner's copies (swaps, partial-page prefixes) and writes shows every running request
its own tokens at every computed position; in the end every request that was not
cancelled has all its tokens and every block is free again."""

import random

import pytest

from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.outputs import RequestStatus
from engine.core.requests import RequestState
from engine.core.scheduler import Scheduler


def random_request(rng: random.Random, index: int, shared_prefix: list[int]) -> RequestState:
    prompt = shared_prefix[:rng.randint(0, len(shared_prefix))] + \
        [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]
    return RequestState(f"r{index}", prompt, rng.randint(1, 12), (), SamplingParams())


PAGE = 4


class ShadowCache:
    """Which token each device slot and pool slot holds, as the runner would leave them."""

    def __init__(self) -> None:
        self.device: dict[int, int] = {}
        self.pool: dict[int, int] = {}

    def run(self, batch) -> None:
        for source, target, blocks_from, blocks_to in (
                (self.device, self.pool, *zip(*batch.swap_out or [((), ())])),
                (self.pool, self.device, *zip(*batch.swap_in or [((), ())]))):
            for from_ids, to_ids in zip(blocks_from, blocks_to):
                for a, b in zip(from_ids, to_ids):
                    for offset in range(PAGE):
                        if a * PAGE + offset in source:
                            target[b * PAGE + offset] = source[a * PAGE + offset]
        sources = {source for source, _, _ in batch.prefix_copies}
        assert sources.isdisjoint(target for _, target, _ in batch.prefix_copies)
        for source_block, target_block, count in batch.prefix_copies:
            for offset in range(count):
                token = self.device[source_block * PAGE + offset]
                self.device[target_block * PAGE + offset] = token
        for entry in batch.entries:
            request = entry.request
            tokens = request.tokens_between(entry.start, entry.end)
            for position, token in zip(range(entry.start, entry.end), tokens):
                self.device[request.block_ids[position // PAGE] * PAGE + position % PAGE] = token

    def check(self, request: RequestState) -> None:
        tokens = request.all_tokens()
        for position in range(request.num_computed_tokens):
            slot = request.block_ids[position // PAGE] * PAGE + position % PAGE
            assert self.device.get(slot) == tokens[position], (request.request_id, position)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_finishes_without_leaks(policy, seed):
    rng = random.Random(seed)
    offload = BlockAllocator(6) if seed % 2 else None
    scheduler = Scheduler(BlockAllocator(12, enable_caching=seed % 3 != 0), PAGE,
                          rng.choice([8, 16, 64]), rng.choice([2, 4, 16]),
                          rng.choice([0.0, 0.15]), policy, offload_allocator=offload)
    shared_prefix = [rng.randrange(3, 50) for _ in range(16)]
    live, cancelled, finished = {}, set(), {}
    shadow = ShadowCache()

    def add(request: RequestState) -> None:
        if request.max_total_tokens <= 12 * 4:               # the add-time length check
            live[request.request_id] = request
            scheduler.add(request)

    for index in range(30):
        add(random_request(rng, index, shared_prefix))
    for step in range(3000):
        if step % 9 == 0 and step < 900:     # later arrivals: some continue a finished
            index = 30 + step // 9           # request (the next turn of a conversation)
            earlier = rng.choice(sorted(finished)) if finished and rng.random() < 0.5 else None
            request = random_request(rng, index, shared_prefix)
            if earlier is not None:
                request.prompt_ids = finished[earlier].all_tokens() + request.prompt_ids[-2:]
                request.max_new_tokens = min(request.max_new_tokens,
                                             max(1, 12 * 4 - len(request.prompt_ids)))
            add(request)
        if rng.random() < 0.03 and live:
            victim = rng.choice(sorted(live))
            scheduler.remove(victim)
            cancelled.add(live.pop(victim).request_id)
        batch = scheduler.schedule()
        if batch is None:
            assert not scheduler.has_work()
            if step >= 900:
                break
            continue                         # idle until the next arrival
        assert batch.num_tokens <= scheduler.max_batch_tokens
        assert len(batch.entries) <= scheduler.max_requests_per_batch
        shadow.run(batch)
        for entry in batch.entries:
            assert len(entry.request.block_ids) * 4 >= entry.end     # room for every token
            entry.request.num_computed_tokens = entry.end
            if entry.samples:
                entry.request.append_token(rng.randrange(3, 50))
            if entry.request.status is RequestStatus.FINISHED:
                scheduler.finish(entry.request)
                finished[entry.request.request_id] = live.pop(entry.request.request_id)
        scheduler.check_invariants()
        for request in scheduler.running:
            shadow.check(request)
    # the tiny cache really was under pressure or shared (else the test proves little)
    assert scheduler.num_preemptions or scheduler.blocks.prefix_hit_tokens
    assert not live and not scheduler.has_work()
    assert all(len(r.generated_tokens) == r.max_new_tokens for r in finished.values())
    assert len(finished) + len(cancelled) >= 1
    scheduler.schedule()                                    # frees the last swap-ins' slots
    assert scheduler.allocator.num_free_blocks == 12
    if offload is not None:
        assert offload.num_free_blocks == 6

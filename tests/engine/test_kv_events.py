"""KV cache events from the prefix cache: a subscriber that applies every step's
events to its own index always holds exactly the blocks the allocator has indexed,
and each BlockStored's hashes chain from its parent over its own tokens."""

import random

import pytest

from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.block_hash import hash_block
from engine.kv_cache.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                       KVEventLog)
from engine.outputs import RequestStatus
from engine.core.requests import RequestState
from engine.core.scheduler import Scheduler

PAGE = 4


class MirrorIndex:
    """What a router knows of one replica's cache, from its events alone."""

    def __init__(self) -> None:
        self.tokens: dict[bytes, tuple[int, ...]] = {}
        self.num_stored = self.num_removed = 0

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    assert block_hash in self.tokens, "removal of a block never stored"
                    del self.tokens[block_hash]
                    self.num_removed += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.tokens.clear()

    def _store(self, event: BlockStored) -> None:
        assert event.block_size == PAGE
        assert len(event.token_ids) == PAGE * len(event.block_hashes)
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * PAGE:(index + 1) * PAGE]
            assert block_hash == hash_block(parent, tokens), "hash does not chain"
            assert block_hash not in self.tokens, "stored twice while cached"
            self.tokens[block_hash] = tokens
            self.num_stored += 1
            parent = block_hash

    def check_matches(self, allocator: BlockAllocator) -> None:
        assert len(self.tokens) == allocator.num_cached_blocks
        for block_hash in self.tokens:
            assert allocator.lookup([block_hash]), "announced block is not cached"


def test_the_log_merges_consecutive_removals_and_drains_once():
    log = KVEventLog()
    log.cleared()
    log.removed(b"a")
    log.removed(b"b")
    log.stored([b"c"], None, [1, 2, 3, 4], 4)
    log.removed(b"d")
    log.stored([], None, [], 4)                 # nothing newly indexed: no event
    assert log.drain() == [AllBlocksCleared(), BlockRemoved((b"a", b"b")),
                           BlockStored((b"c",), None, (1, 2, 3, 4), 4),
                           BlockRemoved((b"d",))]
    assert log.drain() == []


def test_without_a_log_nothing_is_recorded():
    allocator = BlockAllocator(2, enable_caching=True)
    assert allocator.events is None
    [block] = allocator.allocate(1)
    assert allocator.register(block, b"x") is True
    assert allocator.register(block, b"x") is False       # already indexed


@pytest.mark.parametrize("seed", range(4))
def test_events_mirror_the_prefix_cache_under_eviction(seed):
    rng = random.Random(seed)
    allocator = BlockAllocator(14, enable_caching=True)
    allocator.events = log = KVEventLog()
    scheduler = Scheduler(allocator, PAGE, 16, 4, 0.0, "fifo")
    mirror = MirrorIndex()
    prefixes = [[rng.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    pending = []
    for index in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(4, 12)] + \
            [rng.randrange(3, 50) for _ in range(rng.randint(1, 10))]
        pending.append(RequestState(f"r{index}", prompt, rng.randint(1, 6), (),
                                    SamplingParams()))
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            scheduler.add(pending.pop())
        batch = scheduler.schedule()
        if batch is not None:
            for entry in batch.entries:
                entry.request.num_computed_tokens = entry.end
                if entry.samples:
                    entry.request.append_token(rng.randrange(3, 50))
                if entry.request.status is RequestStatus.FINISHED:
                    scheduler.finish(entry.request)
        mirror.apply(log.drain())
        mirror.check_matches(allocator)
        if not pending and not scheduler.has_work():
            break
    assert not pending and not scheduler.has_work()
    assert mirror.num_removed > 0 and mirror.num_stored > mirror.num_removed
    assert scheduler.blocks.prefix_hit_tokens > 0

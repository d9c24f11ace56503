"""BlockAllocator: owns which KV blocks are free, who holds the others, and which
blocks hold a known prefix (prefix caching). Pure Python (no torch).

A block is one page of `page_size` token slots in every layer. Reference counts let
several requests hold one block. A block nobody holds is either
- free: never hashed or already evicted (`_free`, last freed = first reused, so a
  small working set of blocks stays hot in memory and unused pages are never touched),
  or
- cached: it still holds the K/V of a full block with a known content hash, kept in
  `_evictable` (least recently released first) so a later request with the same prefix
  can take it back without recomputing it.
`allocate` hands out free blocks first and only then evicts cached ones, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from .kv_events import KVEventLog


class OutOfBlocksError(RuntimeError):
    """Raised by `allocate` when fewer blocks are available than asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._times_allocated = [0] * num_blocks
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events: KVEventLog | None = None
        """Where evictions are recorded while KV events are published (kv_events.py)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to `allocate` (free or cached-but-unheld)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def usage(self) -> float:
        """Share of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks (refcount 1 each), evicting cached ones only when the free
        list runs dry. All or nothing."""
        if count > self.num_free_blocks:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free_blocks} available")
        block_ids = []
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted = self._hash_of_block.pop(block_id)
                del self._block_of_hash[evicted]
                self.num_evictions += 1
                if self.events is not None:
                    self.events.removed(evicted)
            self._ref_counts[block_id] = 1
            self._times_allocated[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def times_allocated(self, block_id: int) -> int:
        """How often `allocate` has handed the block out: while it has not changed,
        a free block still holds what its last holder wrote (partial_prefix.py)."""
        return self._times_allocated[block_id]

    def is_free(self, block_id: int) -> bool:
        """Held by nobody and not cached: on the free list."""
        return self._ref_counts[block_id] == 0 and block_id not in self._hash_of_block

    def take_free(self, block_id: int) -> None:
        """Hold a block of the free list (refcount 1) without counting an allocation:
        its contents stay what they were; `free` puts it back."""
        if not self.is_free(block_id):
            raise ValueError(f"block {block_id} is not free")
        self._free.remove(block_id)
        self._ref_counts[block_id] = 1

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block; a cached unheld block is taken back."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise ValueError(f"block {block_id} is free and cannot be shared")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block. Pass a request's blocks tail first: the
        end of a prefix is then evicted before its start."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                if block_id in self._hash_of_block:
                    self._evictable[block_id] = None
                else:
                    self._free.appendleft(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- prefix caching --------------------------------------------------------------
    def lookup(self, block_hashes: Iterable[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes` (not taken)."""
        found = []
        if self.enable_caching:
            for block_hash in block_hashes:
                block_id = self._block_of_hash.get(block_hash)
                if block_id is None:
                    break
                found.append(block_id)
        return found

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Record that held block `block_id` now holds the full block `block_hash`;
        True when it is newly indexed. The first block registered for a hash stays
        its owner."""
        if not self.enable_caching or block_hash in self._block_of_hash:
            return False
        if block_id in self._hash_of_block:
            return False
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        return True

    def check_invariants(self, holders: Iterable[list[int]] = ()) -> None:
        """Assert the bookkeeping is consistent.

        `holders` are the block lists of every live request; each block's refcount
        must equal the number of lists holding it; unheld blocks must be exactly the
        free plus the cached-unheld ones; the hash maps must mirror each other. Tests
        call this after every scenario: a leak or a double free shows up here.
        """
        expected = [0] * self.num_blocks
        for block_ids in holders:
            for block_id in block_ids:
                expected[block_id] += 1
        if expected != self._ref_counts:
            wrong = [b for b in range(self.num_blocks) if expected[b] != self._ref_counts[b]]
            raise AssertionError(f"refcounts disagree with holders for blocks {wrong[:16]}")
        free_set, evictable = set(self._free), set(self._evictable)
        if len(free_set) != len(self._free) or free_set & evictable:
            raise AssertionError("a block is listed twice among unheld blocks")
        unheld = {b for b in range(self.num_blocks) if self._ref_counts[b] == 0}
        if free_set | evictable != unheld:
            raise AssertionError("unheld blocks differ from the free and cached lists")
        if not evictable <= set(self._hash_of_block):
            raise AssertionError("a cached block has no hash")
        if {v: k for k, v in self._hash_of_block.items()} != self._block_of_hash:
            raise AssertionError("hash maps disagree")

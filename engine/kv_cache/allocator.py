"""BlockAllocator: owns which KV blocks are free and who holds the others.

Pure Python (no torch): the scheduler asks it for block ids; the runner only ever sees
the ids it was handed. A block is one page of `page_size` token slots in every layer.

Reference counts let several requests hold one block (prefix sharing); a block returns
to the free list when its count drops to zero. Free blocks are handed out in FIFO
order of release, which keeps allocation deterministic for tests.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised by `allocate` when fewer blocks are free than asked for."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (refcount 1 each). All or nothing."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one holder to blocks already in use."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks nobody holds become free."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_invariants(self, holders: Iterable[list[int]] = ()) -> None:
        """Assert the bookkeeping is consistent.

        `holders` are the block lists of every live request; each block's refcount
        must equal the number of lists holding it, and free blocks must be exactly
        those with refcount zero. Tests call this after every scenario: a leak or a
        double free shows up here.
        """
        expected = [0] * self.num_blocks
        for block_ids in holders:
            for block_id in block_ids:
                expected[block_id] += 1
        if expected != self._ref_counts:
            leaked = [b for b in range(self.num_blocks) if expected[b] != self._ref_counts[b]]
            raise AssertionError(f"refcounts disagree with holders for blocks {leaked[:16]}")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        zero = {b for b in range(self.num_blocks) if self._ref_counts[b] == 0}
        if free_set != zero:
            raise AssertionError("free list differs from the blocks nobody holds")

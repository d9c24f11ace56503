"""KV cache events: what the prefix cache announces about the full blocks it holds.
Pure Python (no torch, no sockets).

A KV-aware router (one that sends each request to the replica already caching its
prefix) follows each replica's cache through three kinds of event, the ones vLLM
publishes:

    BlockStored       full blocks newly indexed by the prefix cache: their hashes
                      (block_hash.py), the hash of the block before the first one
                      (None at the start of a sequence), their token ids, page size
    BlockRemoved      indexed blocks evicted for reuse: their hashes
    AllBlocksCleared  the whole index is gone (announced when publishing starts, so
                      a subscriber that knew an earlier process at this address
                      forgets it)

The allocator records evictions and the block manager the blocks it registers, in a
KVEventLog that exists only when someone listens (EngineLoop.set_kv_event_sink). The
engine thread drains the log after each step and hands the events to the sink, a
plain callable; encoding them for the wire is the sink's business
(server/kv_event_publisher.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    """Consecutive full blocks of one sequence, each the parent of the next."""
    parent_block_hash: bytes | None
    """The block before the first one; None when the first one starts the sequence."""
    token_ids: tuple[int, ...]
    """block_size tokens per block, in block order."""
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
KVEventSink = Callable[[list[KVCacheEvent]], None]
"""Called on the engine thread with one step's events, in order; it must not block
(a publisher queues them and returns)."""


class KVEventLog:
    """The events of the step being built, in the order they happened. Engine thread
    only. Consecutive evictions share one BlockRemoved."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []
        self._removed: list[bytes] = []

    def stored(self, block_hashes: Sequence[bytes], parent_block_hash: bytes | None,
               token_ids: Sequence[int], block_size: int) -> None:
        if not block_hashes:
            return
        self._flush_removed()
        self._events.append(BlockStored(tuple(block_hashes), parent_block_hash,
                                        tuple(token_ids), block_size))

    def removed(self, block_hash: bytes) -> None:
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._removed = []
        self._events.append(AllBlocksCleared())

    def drain(self) -> list[KVCacheEvent]:
        """The events recorded since the last drain; the log is empty afterwards."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed)))
            self._removed = []

"""KV cache events on the wire: vLLM's msgpack `KVEventBatch`, byte for byte.

vLLM declares its events as msgspec structs with `array_like=True` (each struct is a
msgpack array of its fields in declaration order, none left out) and `tag=True` on
the events (the array starts with the class name). So one batch is

    [ts, [event, ...], data_parallel_rank]
        ts                   float64, seconds since the epoch (time.time())
        data_parallel_rank   0 (one engine per server)

and the events are

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

with `lora_id` and `lora_name` nil (no adapters here) and `medium` "GPU": vLLM's name
for the engine's own KV cache, which consumers treat as the serving tier (ours may
sit in host memory on a CPU server; it is still the cache requests are served from).
BlockStored carries consecutive blocks, each the parent of the next, and their
tokens concatenated. Decoders written for vLLM releases whose BlockStored has fewer
fields (no `lora_name`, no `medium`) read this too: msgspec ignores trailing fields.

Hashes are vLLM's "external" block hashes: unsigned 64-bit integers, the last 8
bytes (big-endian) of the full block hash, as vLLM converts its own sha256 hashes.
Ours are 16-byte blake2b digests chained over (parent hash, token ids)
(engine/kv_cache/block_hash.py), so the integers are unique per prefix but are not
the ones vLLM would compute for the same tokens: routers must take the hashes from
these events (docs/kv-events.md).
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack

from engine.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

MEDIUM = "GPU"
DATA_PARALLEL_RANK = 0


def external_hash(block_hash: bytes) -> int:
    """The 64-bit integer announced for one of our block hashes."""
    return int.from_bytes(block_hash[-8:], "big")


def event_fields(event: KVCacheEvent) -> list[Any]:
    """One event as the msgpack array vLLM sends for it."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return ["BlockStored", [external_hash(h) for h in event.block_hashes],
                None if parent is None else external_hash(parent), list(event.token_ids),
                event.block_size, None, MEDIUM, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [external_hash(h) for h in event.block_hashes], MEDIUM]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(events: Sequence[KVCacheEvent], ts: float) -> bytes:
    """A KVEventBatch payload (the third frame of a published message)."""
    return msgpack.packb([float(ts), [event_fields(e) for e in events], DATA_PARALLEL_RANK],
                         use_bin_type=True)

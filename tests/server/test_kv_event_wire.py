"""KV cache events on the wire: the msgpack KVEventBatch, byte for byte what vLLM's
msgspec structs encode; the config's errors name their field; the ZMQ publisher's
messages, replay and bounded queue."""

import struct
import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from engine.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from server.kv_event_publisher import KVEventPublisher
from server.kv_event_wire import encode_batch, external_hash
from server.kv_events_config import KVEventsConfig
from tests.server.conftest import free_port

PARENT = bytes(range(16))
FIRST = bytes(range(100, 116))
SECOND = b"\xff" * 16
EVENTS = [AllBlocksCleared(),
          BlockStored((FIRST, SECOND), PARENT, (1, 2, 3, 4, 5, 6, 7, 8), 4),
          BlockStored((PARENT,), None, (9, 10, 11, 12), 4),
          BlockRemoved((FIRST, SECOND))]


def test_hashes_are_the_last_eight_bytes_big_endian():
    assert external_hash(PARENT) == 0x08090A0B0C0D0E0F
    assert external_hash(SECOND) == 2**64 - 1


def test_the_batch_is_vllms_array_layout():
    ts = 1700000000.25
    assert msgpack.unpackb(encode_batch(EVENTS, ts)) == [
        ts,
        [["AllBlocksCleared"],
         ["BlockStored", [external_hash(FIRST), 2**64 - 1], 0x08090A0B0C0D0E0F,
          [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
         ["BlockStored", [0x08090A0B0C0D0E0F], None, [9, 10, 11, 12], 4, None, "GPU", None],
         ["BlockRemoved", [external_hash(FIRST), 2**64 - 1], "GPU"]],
        0]
    # by hand: a 3-array of a float64, an empty array and the positive fixint 0
    assert encode_batch([], ts) == b"\x93\xcb" + struct.pack(">d", ts) + b"\x90\x00"


# vLLM's event declarations (array_like, tagged), for the encoder to be checked against
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredSpec(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemovedSpec(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedSpec(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatchSpec(_Batch):
    events: list[BlockStoredSpec | BlockRemovedSpec | AllBlocksClearedSpec]


class OlderBlockStored(_Event, tag="BlockStored"):
    """An earlier release's BlockStored, without `medium` and `lora_name`."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OlderBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[OlderBlockStored | BlockRemovedSpec | AllBlocksClearedSpec]


def test_bytes_equal_msgspecs_encoding_and_decode_with_vllms_types():
    ts = 12.5
    ours = encode_batch(EVENTS, ts)
    theirs = msgspec.msgpack.encode(KVEventBatchSpec(ts=ts, events=[
        AllBlocksClearedSpec(),
        BlockStoredSpec([external_hash(FIRST), 2**64 - 1], external_hash(PARENT),
                        [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None),
        BlockStoredSpec([external_hash(PARENT)], None, [9, 10, 11, 12], 4, None, "GPU", None),
        BlockRemovedSpec([external_hash(FIRST), 2**64 - 1], "GPU")], data_parallel_rank=0))
    assert ours == theirs
    decoded = msgspec.msgpack.decode(ours, type=KVEventBatchSpec)
    assert decoded.events[1].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    older = msgspec.msgpack.decode(ours, type=OlderBatch)
    assert older.events[2].parent_block_hash is None


@pytest.mark.parametrize("value, field", [
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"endpoint": "5557"}', "endpoint"),
    ('{"replay_endpoint": 5558}', "replay_endpoint"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"hwm": -1}', "hwm"),
    ('{"max_queue_size": 1.5}', "max_queue_size"),
    ('{"topic": 3}', "topic"),
    ('{"endpoints": "tcp://*:1"}', "endpoints"),
    ('{"enable_kv_cache_events": tru', "not JSON"),
])
def test_bad_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        KVEventsConfig.from_any(value)


def test_config_defaults_follow_vllm():
    assert KVEventsConfig.from_any("null") is None
    on = KVEventsConfig.from_any('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.replay_endpoint, on.publishes, on.binds) == \
        ("zmq", "tcp://*:5557", None, True, True)
    assert not KVEventsConfig.from_any('{"publisher": "zmq"}').publishes
    assert not KVEventsConfig(endpoint="tcp://127.0.0.1:9").binds


def replay(context: zmq.Context, address: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for the batches from `start` on, as a DEALER client."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(address)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_publisher_sends_numbered_batches_and_replays_them(tmp_path):
    replay_port = free_port()
    publisher = KVEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/kv",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv", buffer_steps=3))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        assert publisher.config.binds
        sub.connect(f"ipc://{tmp_path}/kv")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)                            # the subscription reaches the PUB
        for index in range(5):
            publisher.submit([BlockRemoved((bytes([index]) * 16,))])
        received = []
        while len(received) < 5:
            assert sub.poll(5000), f"only {len(received)} batches arrived"
            received.append(sub.recv_multipart())
        assert [frames[0] for frames in received] == [b"kv"] * 5
        assert [int.from_bytes(f[1], "big") for f in received] == list(range(5))
        batch = msgpack.unpackb(received[4][2])
        assert batch[1] == [["BlockRemoved", [external_hash(bytes([4]) * 16)], "GPU"]]
        assert time.time() - 60 < batch[0] <= time.time()
        replayed = replay(context, f"tcp://127.0.0.1:{replay_port}", 1)
        assert replayed == [(seq, received[seq][2]) for seq in (2, 3, 4)]   # 3 kept
        assert replay(context, f"tcp://127.0.0.1:{replay_port}", 4) == \
            [(4, received[4][2])]
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()
    assert publisher.num_published == 5 and publisher.num_dropped == 0


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    publisher = KVEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint="inproc://kv-drop", max_queue_size=1))
    started = time.perf_counter()
    for _ in range(2000):
        publisher.submit([AllBlocksCleared()])
    elapsed = time.perf_counter() - started
    publisher.close()
    assert publisher.num_dropped > 0
    assert publisher.num_published + publisher.num_dropped == 2000
    assert elapsed < 5


def test_a_taken_port_is_an_error_naming_the_field():
    port = free_port()
    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(RuntimeError, match="kv_events_config.replay_endpoint"):
            KVEventPublisher(KVEventsConfig(
                enable_kv_cache_events=True, endpoint="tcp://*:0",
                replay_endpoint=f"tcp://127.0.0.1:{port}"))
    finally:
        holder.close(linger=0)
        context.term()

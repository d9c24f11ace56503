"""End to end: a server started with --kv-events-config publishes its prefix cache's
events in vLLM's wire format. A subscriber that follows them sees every full block of
every prompt announced with its tokens and its parent, never twice while cached,
every removal naming a block it was told about, evictions under a small cache, and
ends with as many blocks as the server reports cached; the replay socket returns
every batch, the ones the subscriber missed at start included."""

import json
import random
import time

import httpx
import msgpack
import pytest
import zmq

from engine.kv_cache.block_hash import hash_block
from server.kv_event_wire import external_hash
from tests.server.conftest import API_KEY, free_port, launch_server
from tests.server.test_kv_event_wire import replay

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PAGE = 16
NUM_BLOCKS = 24        # 384 tokens: the prompts below need many times that


@pytest.fixture(scope="module")
def publishing(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-events")
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"ipc://{folder}/events",     # (a tcp address would bind all
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",   # interfaces: `*`)
              "buffer_steps": 10000, "topic": "kvserve"}
    for server in launch_server(tmp_path_factory, [
            "--api-key", API_KEY, "--page-size", str(PAGE), "--num-blocks", str(NUM_BLOCKS),
            "--kv-events-config", json.dumps(config)]):
        yield server, config


def prompts() -> list[list[int]]:
    """Two shared 3-block prefixes with three endings each, then distinct prompts."""
    rng = random.Random(7)
    tokens = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]   # noqa: E731
    shared = [tokens(3 * PAGE) for _ in range(2)]
    return [prefix + tokens(20) for prefix in shared for _ in range(3)] + \
        [tokens(4 * PAGE + 5) for _ in range(10)]


def block_chain(prompt: list[int]) -> list[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent hash, tokens) of each full block of `prompt`, as announced."""
    chain, parent = [], None
    for start in range(0, len(prompt) // PAGE * PAGE, PAGE):
        tokens = tuple(prompt[start:start + PAGE])
        block = hash_block(parent, tokens)
        chain.append((external_hash(block), None if parent is None else external_hash(parent),
                      tokens))
        parent = block
    return chain


def receive_until_quiet(sub: zmq.Socket, quiet_s: float = 1.5) -> list[list[bytes]]:
    messages = []
    while sub.poll(int(quiet_s * 1000)):
        messages.append(sub.recv_multipart())
    return messages


def follow(batches: list[list]) -> tuple[dict, dict, int]:
    """Apply decoded batches in order as a router would; returns the live index
    {hash: tokens}, every stored block's (parent, tokens), and the removals."""
    live, announced, removals = {}, {}, 0
    for _, events, rank in batches:
        assert rank == 0
        for event in events:
            if event[0] == "BlockStored":
                _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = event
                assert (block_size, lora_id, medium, lora_name) == (PAGE, None, "GPU", None)
                assert len(tokens) == PAGE * len(hashes)
                for index, block in enumerate(hashes):
                    own = tuple(tokens[index * PAGE:(index + 1) * PAGE])
                    assert block not in live, "announced twice while cached"
                    assert announced.setdefault(block, (parent, own)) == (parent, own)
                    live[block] = own
                    parent = block
            elif event[0] == "BlockRemoved":
                assert event[2] == "GPU"
                for block in event[1]:
                    assert block in live, "removal of a block not announced"
                    del live[block]
                    removals += 1
            else:
                assert event == ["AllBlocksCleared"]
                live.clear()
    return live, announced, removals


def test_subscriber_follows_the_prefix_cache(publishing):
    server, config = publishing
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(config["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"kvserve")
    try:
        time.sleep(0.5)                          # the subscription reaches the server
        sent = prompts()
        for prompt in sent:
            response = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers(),
                                  json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                        "temperature": 0}, timeout=120)
            assert response.status_code == 200, response.text
        received = receive_until_quiet(sub)
        replayed = replay(context, config["replay_endpoint"], 0)
    finally:
        sub.close(linger=0)
        context.term()
    assert received, "no batch published while requests ran"
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    by_seq = dict(replayed)
    for topic, seq, payload in received:
        assert topic == b"kvserve" and by_seq[int.from_bytes(seq, "big")] == payload
    assert int.from_bytes(received[-1][1], "big") == len(replayed) - 1
    batches = [msgpack.unpackb(payload) for _, payload in replayed]
    assert batches[0][1][0] == ["AllBlocksCleared"]     # at start, before any request
    live, announced, removals = follow(batches)
    for prompt in sent:
        for block, parent, tokens in block_chain(prompt):
            assert announced.get(block) == (parent, tokens)
    assert removals > 0, "the small cache never evicted"
    assert len(announced) > NUM_BLOCKS
    metrics = server.metrics()
    assert len(live) == metrics["kvserve:kv_cache_cached_blocks{}"]
    assert metrics["kvserve:kv_event_batches_published_total{}"] == len(replayed)
    assert metrics["kvserve:kv_event_batches_dropped_total{}"] == 0

"""End to end: the server's life and death.

- SIGTERM while 8 streams run: each stream finishes; meanwhile the listener stays up,
  /ready and new requests answer 503; then the process exits 0; requests still
  running when the drain window closes end with a 503 error (in-band plus [DONE] for
  a stream).
- The engine thread dies (a fault injected into its step, through the testing-only
  route): every waiting client gets an error body, never a hang; /health turns red;
  new requests are refused with 503.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NUM_STREAMS = 8
TOKENS = 96


@pytest.fixture
def drain_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, [
        "--page-size", "16", "--num-blocks", "128", "--drain-timeout", "60"])


async def read_stream(http, url, body, first_chunk: asyncio.Event):
    """Stream a chat answer; return (text, finish_reason, usage, saw [DONE])."""
    text, finish, usage, done = "", None, None, False
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
                if text:
                    first_chunk.set()
    return text, finish, usage, done


def draining_answers(url: str, body: dict) -> tuple[int, int, str]:
    """During the drain: /ready's status, a new chat's status and error code."""
    time.sleep(0.3)                              # the signal has been handled
    ready = httpx.get(f"{url}/ready", timeout=5).status_code
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    chat = httpx.post(f"{url}/v1/chat/completions", json=plain, timeout=5)
    return ready, chat.status_code, chat.json()["error"]["code"]


def test_sigterm_lets_running_streams_finish_and_exits_0(drain_server):
    url = f"{drain_server.base_url}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def scenario():
        firsts = [asyncio.Event() for _ in range(NUM_STREAMS)]
        async with httpx.AsyncClient(timeout=120) as http:
            tasks = [asyncio.create_task(read_stream(http, url, body, first)) for first in firsts]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
            running = drain_server.health()["num_running"]
            os.kill(drain_server.process.pid, signal.SIGTERM)
            answers = await asyncio.to_thread(draining_answers, drain_server.base_url, body)
            return running, answers, await asyncio.gather(*tasks)

    running, answers, results = asyncio.run(scenario())
    assert running == NUM_STREAMS
    assert answers == (503, 503, "server_shutting_down"), answers
    for text, finish, usage, done in results:
        assert text and finish == "length" and done
        assert usage["completion_tokens"] == TOKENS
    assert drain_server.process.wait(timeout=60) == 0
    log = drain_server.log_tail()
    assert f"received SIGTERM: draining {NUM_STREAMS} running" in log


@pytest.fixture
def short_drain_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, [
        "--page-size", "16", "--num-blocks", "512", "--drain-timeout", "3"])


def test_requests_outliving_the_drain_get_an_error_and_done(short_drain_server):
    """A stream still running when the drain window closes ends with an in-band 503
    error and [DONE]; a waiting non-streaming request gets a 503 body; exit 0."""
    url = f"{short_drain_server.base_url}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0}

    async def stream_events(http, started: asyncio.Event):
        events = []
        async with http.stream("POST", url, json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
        return events

    async def scenario():
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as http:
            streaming = asyncio.create_task(stream_events(http, started))
            whole = asyncio.create_task(http.post(url, json=body))
            await asyncio.wait_for(started.wait(), 120)
            os.kill(short_drain_server.process.pid, signal.SIGTERM)
            return await streaming, await whole

    events, whole = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down"
    assert whole.status_code == 503
    assert whole.json()["error"]["code"] == "server_shutting_down"
    assert short_drain_server.process.wait(timeout=30) == 0


# 16 blocks of 16 tokens: a ~75-token chat prompt takes 5 of them (only the first,
# the system prompt, is shared between the requests), so at most three requests run
# and the others wait in the queue; each asks for 150 tokens, so none can finish
# before the fault is armed (decode runs at ~10 ms per token).
FAULT_FLAGS = ["--page-size", "16", "--num-blocks", "16", "--enable-fault-injection", "true"]


@pytest.fixture
def fault_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, FAULT_FLAGS)


def test_engine_death_fails_every_request_and_turns_health_red(fault_server):
    base = fault_server.base_url

    def body(i: int) -> dict:
        story = f"Story {i}: " + "once upon a time in a land far away " * 4
        return {"model": MODEL, "messages": [{"role": "user", "content": story}],
                "max_tokens": 150, "ignore_eos": True}

    async def scenario():
        first = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as http:
            streams = [asyncio.create_task(read_stream_events(http, f"{base}/v1/chat/completions",
                                                              {**body(i), "stream": True}, first))
                       for i in range(2)]
            plain = [asyncio.create_task(http.post(f"{base}/v1/chat/completions", json=body(i)))
                     for i in range(2, 4)]
            await asyncio.wait_for(first.wait(), 60)
            health = (await http.get(f"{base}/health")).json()
            armed = await http.post(f"{base}/debug/fail-engine")
            done = await asyncio.wait_for(asyncio.gather(*streams, *plain), 30)  # no hang
            return health, armed, done

    health, armed, (stream_a, stream_b, plain_a, plain_b) = asyncio.run(scenario())
    assert health["num_running"] >= 1 and health["num_waiting"] >= 1  # both kinds fail
    assert armed.status_code == 200
    for events in (stream_a, stream_b):
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == "generation_failed"
    for response in (plain_a, plain_b):
        assert response.status_code == 500, response.text
        assert response.json()["error"]["code"] == "generation_failed"
    red = httpx.get(f"{base}/health")
    assert red.status_code == 503 and red.json()["error"]["code"] == "engine_stopped"
    assert httpx.get(f"{base}/ready").status_code == 503
    late = httpx.post(f"{base}/v1/chat/completions", json=body(5), timeout=30)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_stopped"
    metrics = fault_server.metrics()
    assert metrics["kvserve:engine_alive{}"] == 0
    assert metrics["vllm:request_success_total{finished_reason=error}"] == 4


async def read_stream_events(http, url, body, first: asyncio.Event) -> list[str]:
    """Every `data:` payload of a stream, as text; sets `first` on the first token."""
    events = []
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if '"content":"' in line and '"content":""' not in line:
                    first.set()
    return events

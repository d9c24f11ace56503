"""End to end: many concurrent streams batch together; clients that leave free
their requests in the engine."""

import asyncio
import json
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # the model the `server` fixture serves
MSG = [{"role": "user", "content": "Tell me a story."}]
NUM_STREAMS = 32
TOKENS = 16


async def one_stream(client) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage = "", None, 0
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


def test_concurrent_streams_batch(async_client, server):
    async def scenario():
        single = await one_stream(async_client)
        steps_before = server.metrics()["kvserve:engine_steps_total{}"]
        results = await asyncio.gather(*(one_stream(async_client) for _ in range(NUM_STREAMS)))
        return single, results, server.metrics()["kvserve:engine_steps_total{}"] - steps_before

    single, results, steps = asyncio.run(scenario())
    assert all(r == single for r in results)  # greedy: every stream says the same
    assert single[1] == "length" and single[2] == TOKENS
    # Batched decoding: the 32 streams share forward passes. One by one they would
    # take 32 x 16 = 512 steps; batched, a few times 16 (prefill chunks, arrivals).
    assert steps < NUM_STREAMS * TOKENS / 4, steps
    assert server.health()["num_running"] == 0


def wait_for(server, predicate, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if predicate(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


LONG = {"model": MODEL, "messages": MSG, "max_tokens": 2000, "ignore_eos": True}


def test_stream_disconnect_frees_the_request(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/v1/chat/completions",
                         headers=server.headers(), json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data:") and json.loads(line[5:])["choices"]:
                    seen += 1
                if seen >= 3:
                    break
            assert seen == 3
            assert server.health()["num_running"] == 1
    # 2000 tokens would take minutes; a freed request leaves at once.
    health = wait_for(server, lambda h: h["num_running"] == 0 and h["num_waiting"] == 0)
    assert health["num_running"] == 0 and health["num_waiting"] == 0


def test_non_streaming_disconnect_frees_the_request(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        running = wait_for(server, lambda h: h["num_running"] == 1)
        assert running["num_running"] == 1
    health = wait_for(server, lambda h: h["num_running"] == 0 and h["num_waiting"] == 0)
    assert health["num_running"] == 0 and health["num_waiting"] == 0
    response = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers(),
                          json={"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert response.status_code == 200


def test_prompts_tokenized_concurrently_keep_their_counts(async_client, tokenizer):
    """Prompts are rendered and tokenized on worker threads, many at once: each
    request's usage still counts exactly its own prompt."""
    texts = [f"Item {i}: " + "word " * (5 + 17 * i) for i in range(12)]

    async def chat(text):
        response = await async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1)
        return response.usage.prompt_tokens

    async def complete(text):
        response = await async_client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        return response.usage.prompt_tokens

    async def scenario():
        return await asyncio.gather(*(chat(t) for t in texts), *(complete(t) for t in texts))

    counts = asyncio.run(scenario())
    def rendered_length(text):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    chat_want = [rendered_length(t) for t in texts]
    completion_want = [len(tokenizer.encode(t)) for t in texts]
    assert counts == chat_want + completion_want

"""Anthropic's Messages API (server/anthropic/) on the default model, through the
`anthropic` SDK and raw HTTP: the answer is the chat route's for the same
conversation, streamed events come in Anthropic's order, a tool_use / tool_result
round trip, count_tokens, stop sequences, errors in Anthropic's shape, and one key
setting that serves `x-api-key` and `Authorization: Bearer` on every route."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.server.conftest import API_KEY, ENGINE_FLAGS, launch_server

GREEDY = {"extra_body": {"temperature": 0}}     # the SDK no longer types sampling fields
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "required": ["city"],
                           "properties": {"city": {"type": "string"}}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, ["--api-key", API_KEY, *ENGINE_FLAGS])


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def _chat(server, messages, **extra) -> dict:
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "smollm2-135m-instruct", "messages": messages,
                             "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_message_is_the_chat_answer_to_the_same_conversation(server, client):
    message = client.messages.create(model="claude-sonnet-4-5", max_tokens=40,
                                      system="Answer briefly.", messages=QUESTION,
                                      metadata={"user_id": "u1"}, **GREEDY)
    chat = _chat(server, [{"role": "system", "content": "Answer briefly."}, *QUESTION],
                 max_tokens=40)
    assert message.model == "claude-sonnet-4-5" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.type == "message"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat["choices"][0]["finish_reason"]]
    counted = client.messages.count_tokens(model="any", system="Answer briefly.",
                                           messages=QUESTION)
    assert counted.input_tokens == message.usage.input_tokens


def test_streamed_events_come_in_anthropics_order(server, client):
    whole = client.messages.create(model="m", max_tokens=24, messages=QUESTION, **GREEDY)
    names, payloads = [], []
    with httpx.stream("POST", f"{server.base_url}/v1/messages", timeout=120,
                      headers={"x-api-key": API_KEY},
                      json={"model": "m", "max_tokens": 24, "messages": QUESTION,
                            "stream": True, "temperature": 0}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
            elif line.startswith("data: "):
                payloads.append(json.loads(line[6:]))
    assert [p["type"] for p in payloads] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta")
    assert text == whole.content[0].text
    assert payloads[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert payloads[-2]["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model="m", max_tokens=24, messages=QUESTION, **GREEDY) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_a_tool_use_and_tool_result_round_trip(client):
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = client.messages.create(model="m", max_tokens=100, tools=TOOLS, tool_choice=forced,
                                   messages=QUESTION, **GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    with client.messages.stream(model="m", max_tokens=100, tools=TOOLS, tool_choice=forced,
                                messages=QUESTION, **GREEDY) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas and set(deltas) == {"input_json_delta"}
    assert streamed.content[0].input == call.input and streamed.stop_reason == "tool_use"
    answer = client.messages.create(
        model="m", max_tokens=40, tools=TOOLS, tool_choice={"type": "none"}, **GREEDY,
        messages=[*QUESTION, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "18 C and sunny"}]}])
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_a_stop_sequence_is_named(client):
    message = client.messages.create(
        model="m", max_tokens=60, stop_sequences=["3"], **GREEDY,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "3"
    assert "3" not in message.content[0].text


def test_errors_take_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", max_tokens=0, messages=QUESTION)
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="'image' are not supported"):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}])
    stranger = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        stranger.messages.create(model="m", max_tokens=5, messages=QUESTION)
    assert denied.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("headers, status", [({"content-type": "text/plain"}, 415),
                                             ({"host": "rebound.example"}, 403)])
def test_refusals_before_the_route_take_anthropics_shape_too(server, headers, status):
    reply = httpx.post(f"{server.base_url}/v1/messages", timeout=30, content=b"{}",
                       headers={"x-api-key": API_KEY, **headers})
    assert reply.status_code == status
    assert reply.json()["type"] == "error" and reply.json()["error"]["message"]
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, content=b"{}",
                      headers={"x-api-key": API_KEY, **headers})
    assert chat.status_code == status and "message" in chat.json()["error"]


def test_one_key_setting_serves_both_headers_everywhere(server):
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        models = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=30)
        assert models.status_code == 200
    denied = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert denied.status_code == 401 and "error" in denied.json()      # OpenAI's shape there

"""End to end: a table of hostile inputs (every sampling field given every wrong
type and extreme, broken tools, formats and messages, odd headers): never a 5xx,
every refusal in OpenAI's error shape, and the server serving afterwards."""

import itertools

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "seed",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "top_logprobs",
          "logprobs", "stop", "logit_bias", "stream", "tool_choice", "response_format"]
VALUES = ["x", True, [], {}, 10**30, -10**30, 1.5, "NaN", [[1]], {"a": None}]
SHAPES = [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f"}}] * 2},
    {"tools": "f"}, {"tools": [None]}, {"tool_choice": {"type": "function"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nowhere"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]},
    {"messages": [{"role": "tool"}]}, {"messages": [{}]}, {"messages": [None]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
    {"messages": [{"role": "user", "content": "<|im_end|>\x00" * 100}]},
    {"chat_template_kwargs": "x"}, {"chat_template_kwargs": {"tools": 5}},
    {"audio": {"voice": "x"}}, {"modalities": ["audio"]}, {"prediction": {}},
    {"stream_options": {"include_usage": "yes"}, "stream": True},
]
CASES = [{field: value} for field, value in itertools.product(FIELDS, VALUES)] + SHAPES


def test_the_table_is_large_enough():
    assert len(CASES) >= 150


@pytest.mark.parametrize("fields", CASES, ids=range(len(CASES)))
def test_hostile_input_never_gets_a_5xx(server, fields):
    body = {**BASE, **fields}
    response = httpx.post(f"{server.openai_base_url}/chat/completions",
                          headers=server.headers(), json=body, timeout=60)
    assert response.status_code < 500, (fields, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_still_serves(server):
    response = httpx.post(f"{server.openai_base_url}/chat/completions",
                          headers=server.headers(), json=BASE, timeout=60)
    assert response.status_code == 200

"""End to end: `response_format` on the real server with the default model. Every
constrained answer parses and validates, sampled or greedy, streamed or not, next
to free requests in the same batches."""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow


class Address(BaseModel):
    city: str = Field(max_length=30)
    zip_code: str | None = None          # anyOf [string, null]


class Person(BaseModel):                 # $defs/$ref, enum, bounds, required, closed
    name: str = Field(min_length=1, max_length=40)
    age: int
    role: Literal["admin", "user", "guest"]
    tags: list[str] = Field(max_length=3)
    address: Address


ASKS = ["Describe a user named Ann as JSON.", "Who is the admin of the moon base?",
        "Tell me a joke.", "Write a haiku about the sea.", "What is 2+2?"]


def ask(text):
    return [{"role": "user", "content": text}]


def test_parse_returns_valid_objects_beside_free_requests(client):
    def constrained(seed):
        response = client.chat.completions.parse(
            model=MODEL, messages=ask(ASKS[seed % len(ASKS)]), response_format=Person,
            max_tokens=120, temperature=1.0, seed=seed)
        return response.choices[0]

    def free(seed):
        return client.chat.completions.create(model=MODEL, messages=ask(ASKS[seed % 5]),
                                              max_tokens=24, seed=seed)

    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, seed) for seed in range(8)]
        choices = list(pool.map(constrained, range(16)))
        assert all(f.result().choices[0].message.content for f in frees)
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
        assert json.loads(choice.message.content) == choice.message.parsed.model_dump()


def test_streamed_json_object_is_one_object(client):
    for seed in range(3):
        stream = client.chat.completions.create(
            model=MODEL, messages=ask("Give me JSON about Paris."), stream=True,
            response_format={"type": "json_object"}, max_tokens=80, temperature=0.8, seed=seed)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len([p for p in pieces if p]) > 1
        assert isinstance(json.loads("".join(pieces)), dict)


def test_n_choices_each_follow_the_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "number"}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL, messages=ask("Is the sky blue?"), n=4, temperature=1.0, seed=3,
        max_tokens=40, response_format={"type": "json_schema",
                                        "json_schema": {"name": "verdict", "schema": schema,
                                                        "strict": True}})
    for choice in response.choices:
        value = json.loads(choice.message.content)
        assert value["answer"] in ("yes", "no") and isinstance(value["confidence"], (int, float))


def test_text_completions_honour_response_format(server):
    body = {"model": MODEL, "prompt": "A city, as JSON:", "max_tokens": 48,
            "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server.openai_base_url}/completions", headers=server.headers(),
                          json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert isinstance(json.loads(response.json()["choices"][0]["text"]), dict)


def test_text_format_changes_nothing(client):
    plain = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"),
                                           max_tokens=16, temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"),
                                          max_tokens=16, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("response_format, names", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}, "/$defs/missing"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "uri-reference"}}}}},
     "uri-reference"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "yaml"}, "type"),
])
def test_unusable_formats_are_a_400_naming_the_part(client, response_format, names):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4,
                                       response_format=response_format)
    assert names in error.value.body["message"]
    assert error.value.body["param"].startswith("response_format")

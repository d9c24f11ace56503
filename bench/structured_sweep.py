"""Validity sweep of constrained answers against a running server: many seeds of
sampled (temperature 1) requests under `response_format` and `tool_choice`, streamed
and not, mixed with free requests, each answer parsed and validated.

    python -m bench.structured_sweep --base-url http://127.0.0.1:8000 --requests 200

Reports, per kind of request, how many answers were valid (a JSON schema answer
that parses and validates, a JSON object, tool calls whose arguments validate) and
how many ended by length instead of closing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Literal

import httpx
from pydantic import BaseModel, Field, ValidationError

from .report import write_json
from .serve import server_parser


class Address(BaseModel):
    city: str = Field(max_length=30)
    zip_code: str | None = None


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=40)
    age: int
    role: Literal["admin", "user", "guest"]
    tags: list[str] = Field(max_length=3)
    address: Address


class WeatherArgs(BaseModel):
    model_config = {"extra": "forbid"}
    city: str = Field(max_length=40)
    unit: Literal["C", "F"] | None = None


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
KINDS = ("json_schema", "json_schema_stream", "json_object_stream", "tools_required",
         "tools_auto", "free")
ASKS = ["Describe a user named Ann.", "What is the weather in Oslo?", "Tell me a joke.",
        "Who runs the moon base?", "List three colors."]


def request_body(kind: str, seed: int, model: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": ASKS[seed % len(ASKS)]}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream": kind.endswith("_stream")}
    if kind.startswith("json_schema"):
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema()}}
    elif kind.startswith("json_object"):
        body["response_format"] = {"type": "json_object"}
    elif kind.startswith("tools"):
        body["tools"] = [TOOL]
        body["tool_choice"] = "required" if kind == "tools_required" else "auto"
    return body


def verdict(kind: str, message: dict, finish: str | None) -> str:
    """valid | invalid | length (a free answer is valid when it has content)."""
    try:
        if kind.startswith("json_schema"):
            Person.model_validate_json(message["content"])
        elif kind.startswith("json_object"):
            assert isinstance(json.loads(message["content"]), dict)
        elif kind.startswith("tools"):
            calls = message.get("tool_calls") or []
            assert calls or kind == "tools_auto"
            for call in calls:
                assert call["function"]["name"] == "get_weather"
                WeatherArgs.model_validate_json(call["function"]["arguments"])
        else:
            assert message["content"]
    except (AssertionError, ValidationError, ValueError, TypeError, KeyError):
        return "length" if finish == "length" else "invalid"
    return "valid"


async def one(http: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, str | None]:
    if not body["stream"]:
        choice = (await http.post(url, json=body)).json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    message, finish = {"content": ""}, None
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    message["content"] += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
    return message, finish


async def sweep(args) -> dict:
    url = f"{args.base_url.rstrip('/')}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(args.concurrency)
    counts: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    async with httpx.AsyncClient(timeout=600, headers=headers) as http:
        async def run(index: int) -> None:
            kind = KINDS[index % len(KINDS)]
            async with semaphore:
                message, finish = await one(http, url, request_body(
                    kind, index, args.model, args.max_tokens))
            counts[kind][verdict(kind, message, finish)] += 1

        await asyncio.gather(*(run(i) for i in range(args.requests)))
    return {kind: dict(counter) for kind, counter in counts.items()}


def main(argv=None) -> dict:
    parser = server_parser("python -m bench.structured_sweep", __doc__)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(sweep(args))
    for kind, counter in result.items():
        print(f"{kind:<20} {counter}")
    write_json(args.json, {"requests": args.requests, "max_tokens": args.max_tokens,
                           "results": result})
    return result


if __name__ == "__main__":
    main()

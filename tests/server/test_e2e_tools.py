"""End to end: tool calls on the real server with the default model (whose template
knows nothing of tools: the generic JSON envelope), through the openai SDK,
LangChain and instructor. Constrained calls always parse and validate."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    required = {"get_weather": "city", "get_time": "zone"}[call.function.name]
    assert isinstance(arguments[required], str)
    if call.function.name == "get_weather":
        assert set(arguments) <= {"city", "unit"} and arguments.get("unit", "C") in "CF"
    return arguments


@pytest.mark.parametrize("choice, names", [
    ("required", ("get_weather", "get_time")),
    ({"type": "function", "function": {"name": "get_time"}}, ("get_time",)),
])
def test_required_and_named_calls_validate_over_seeds(client, choice, names):
    def one(seed):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
            max_tokens=60, temperature=1.0, seed=seed).choices[0]

    with ThreadPoolExecutor(8) as pool:
        free = [pool.submit(client.chat.completions.create, model=MODEL, messages=ASK,
                            max_tokens=16, seed=s) for s in range(4)]
        choices = list(pool.map(one, range(12)))
        assert all(f.result().choices[0].message.content for f in free)
    for choice_ in choices:
        assert choice_.finish_reason == "tool_calls" and choice_.message.tool_calls
        for call in choice_.message.tool_calls:
            check_call(call, names)
        if not isinstance(choice, str):
            assert len(choice_.message.tool_calls) == 1


def test_auto_answers_parse_either_way(client):
    for seed in range(4):
        choice = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, seed=seed,
            temperature=1.0, parallel_tool_calls=False).choices[0]
        if choice.finish_reason == "tool_calls":
            assert len(choice.message.tool_calls) == 1
            check_call(choice.message.tool_calls[0])
        else:
            assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls


def test_streamed_calls_arrive_as_openai_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=60, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                assert entry["id"] is None and delta.function.name and delta.type == "function"
                entry["id"], entry["name"] = delta.id, delta.function.name
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["id"] and entry["name"] in ("get_weather", "get_time")
        json.loads(entry["arguments"])


def test_a_tool_loop_runs(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", max_tokens=60)
    message = first.choices[0].message
    history = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}
        for call in message.tool_calls]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=30)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_developer_role_and_client_extras_are_served(server):
    body = {"model": MODEL, "max_tokens": 8, "metadata": {"run": "1"}, "store": False,
            "messages": [{"role": "developer", "content": "Answer briefly."},
                         {"role": "user", "content": "Hi", "id": "msg_1"}]}
    response = httpx.post(f"{server.openai_base_url}/chat/completions",
                          headers=server.headers(), json=body, timeout=60)
    assert response.status_code == 200, response.text
    card = httpx.get(f"{server.openai_base_url}/models", headers=server.headers()).json()
    assert card["data"][0]["tool_parser"] == "generic"


class Weather(BaseModel):
    city: str = Field(max_length=40)
    unit: str = Field(pattern="^[CF]$")


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.openai_base_url, api_key=server.api_key,
                     max_tokens=60, temperature=0)
    reply = llm.bind_tools([Weather], tool_choice="any").invoke("Weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(reply.tool_calls[0]["args"])
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(result, Weather), method


def test_instructor_tools_mode(server):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=server.openai_base_url,
                                           api_key=server.api_key), mode=instructor.Mode.TOOLS)
    result = client.chat.completions.create(model=MODEL, response_model=Weather, max_tokens=60,
                                            messages=[{"role": "user",
                                                       "content": "Weather in Oslo?"}])
    assert isinstance(result, Weather)

"""End to end: POST /v1/responses (OpenAI's Responses API) on the real server with
the default model, through the openai SDK (create, parse, stream) and the openai
Agents SDK. The model is tiny: tool calls are forced (tool_choice required or named)
and structured output goes through the grammar, so what must parse always does."""

import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import SECOND_API_KEY

from server.openai_api.responses_output import output_items
from server.openai_api.responses_stream import ResponseEvents

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
               "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}
ASK = "What is the weather in Paris right now?"


def check_call(item, names=("get_weather", "get_time")):
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert item.name in names
    arguments = json.loads(item.arguments)
    key = {"get_weather": "city", "get_time": "zone"}[item.name]
    assert isinstance(arguments[key], str)
    return arguments


def test_text_response_and_echoed_parameters(client):
    response = client.responses.create(
        model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0.5, top_p=0.9,
        store=True, metadata={"run": "1"}, user="u-1", include=[],
        extra_body={"safety_identifier": "someone"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.status in ("completed", "incomplete")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text
    assert response.output_text == part.text
    usage = response.usage
    assert 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 12)
    assert response.metadata == {"run": "1"} and response.user == "u-1"
    assert response.tools == [] and response.tool_choice == "auto"
    assert response.parallel_tool_calls is True and response.text.format.type == "text"
    assert response.store is True and response.error is None


def test_instructions_come_first(client, server):
    pirate = "You are a pirate. Answer like one."
    told = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                   instructions=pirate)
    assert told.instructions == pirate and told.output_text
    # the prompt is exactly the chat of a system message and the user's
    chat = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(), timeout=30,
                      json={"model": MODEL, "messages": [{"role": "system", "content": pirate},
                                                         {"role": "user", "content": "Hi"}]})
    assert told.usage.input_tokens == chat.json()["count"]


@pytest.mark.parametrize("choice, names", [
    ("required", ("get_weather", "get_time")),
    ({"type": "function", "name": "get_time"}, ("get_time",)),
])
def test_forced_function_calls_validate(client, choice, names):
    response = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                       tool_choice=choice, max_output_tokens=60)
    assert response.status == "completed" and response.output
    for item in response.output:
        check_call(item, names)
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    assert response.output_text == ""


class Verdict(BaseModel):
    answer: str = Field(max_length=20)
    confident: bool


def test_text_format_json_schema(client):
    parsed = client.responses.parse(model=MODEL, input="Is the sky blue? Answer as JSON.",
                                    text_format=Verdict, max_output_tokens=60)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Verdict)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Verdict"
    loose = client.responses.create(model=MODEL, input="A JSON object please.",
                                    text={"format": {"type": "json_object"}},
                                    max_output_tokens=40, temperature=0)
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_function_call_round_trip(client, server):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    history = [{"role": "user", "content": ASK}]
    history += [call.model_dump(exclude_none=True) for call in calls]   # as agent loops do
    history += [{"type": "function_call_output", "call_id": call.call_id,
                 "output": "22 C and sunny"} for call in calls]
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=16)
    assert second.output[0].type == "message" and second.output_text
    # the prompt is exactly the chat of the same turns: calls and their outputs
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
    chat += [{"role": "tool", "tool_call_id": c.call_id, "content": "22 C and sunny"}
             for c in calls]
    count = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(), timeout=30,
                       json={"model": MODEL, "messages": chat}).json()["count"]
    assert second.usage.input_tokens == count
    replay = history + [item.model_dump(exclude_none=True) for item in second.output]
    third = client.responses.create(model=MODEL, input=replay + [
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]}],
        max_output_tokens=4)
    assert third.output_text


def test_stream_text_deltas(client):
    events = []
    with client.responses.stream(model=MODEL, input="What is 2+2?", temperature=0,
                                 max_output_tokens=60) as stream:
        for item in stream:
            events.append(item)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "".join(deltas) == events[-4].text
    assert final.status == "completed" and final.usage.output_tokens >= len(deltas)
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))


def test_stream_function_call(client):
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and all(e.item.type == "function_call" for e in added)
    for event in added:
        index = event.output_index
        of_item = [e for e in events if getattr(e, "output_index", None) == index]
        assert [e.type for e in of_item][0] == "response.output_item.added"
        assert [e.type for e in of_item][-2:] == ["response.function_call_arguments.done",
                                                  "response.output_item.done"]
        arguments = "".join(e.delta for e in of_item
                            if e.type == "response.function_call_arguments.delta")
        assert of_item[-1].item.arguments == arguments == final.output[index].arguments
        check_call(final.output[index], ("get_weather",))


def test_raw_stream_names_events_and_ends_incomplete(server):
    body = {"model": MODEL, "input": "Tell me a long story about the sea.", "stream": True,
            "max_output_tokens": 5}
    with httpx.stream("POST", f"{server.openai_base_url}/responses", json=body,
                      headers=server.headers(), timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    names = []
    for block in blocks:
        event_line, data_line = block.split("\n")
        name = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[-1] == "response.incomplete" and "[DONE]" not in blocks[-1]
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))["response"]
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["status"] == "incomplete" and last["usage"]["output_tokens"] == 5


def test_max_output_tokens_is_incomplete(client):
    response = client.responses.create(model=MODEL, input="Write a long poem about rivers.",
                                       max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_previous_response_id_continues_a_stored_conversation(client):
    """Three turns chained by previous_response_id give the answers the same
    conversation sent whole in `input` gives; instructions are not inherited."""
    turns = ["My name is Ada and I like tea.", "What is my name?", "What do I like?"]
    chained, whole, previous = [], [], None
    for turn in turns:
        response = client.responses.create(model=MODEL, input=turn, max_output_tokens=16,
                                           temperature=0, previous_response_id=previous,
                                           instructions="Be brief." if previous is None else None)
        assert response.previous_response_id == previous and response.store is True
        chained.append(response)
        previous = response.id
    history = []
    for turn, response in zip(turns, chained):
        history.append({"role": "user", "content": turn})
        replay = client.responses.create(model=MODEL, input=list(history), max_output_tokens=16,
                                         temperature=0, store=False,
                                         instructions="Be brief." if len(history) == 1 else None)
        assert replay.output_text == response.output_text
        assert replay.usage.input_tokens == response.usage.input_tokens
        history.append({"role": "assistant", "content": response.output_text})
        whole.append(replay)
    assert chained[2].usage.input_tokens > chained[1].usage.input_tokens > \
        chained[0].usage.input_tokens - 10          # each turn carries the earlier ones


def test_stored_responses_are_read_deleted_and_kept_to_their_key(server, client):
    made = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    stranger = openai.OpenAI(base_url=server.openai_base_url, api_key=SECOND_API_KEY,
                             max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        stranger.responses.create(model=MODEL, input="Hi", previous_response_id=made.id)
    assert caught.value.response.json()["error"]["param"] == "previous_response_id"
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(made.id)
    assert gone.value.response.json()["error"]["code"] == "response_not_found"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    streamed = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    final = [event for event in streamed][-1]
    assert final.type == "response.incomplete"                  # 4 tokens: cut short
    stored = client.responses.retrieve(final.response.id)
    assert stored.output_text == final.response.output_text and stored.status == "incomplete"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                   "output": "x"}]}, "input[1].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
     "text.format"),
])
def test_bad_input_names_the_field(server, body, param):
    response = httpx.post(f"{server.openai_base_url}/responses", json=body,
                          headers=server.headers(), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_api_key_is_required(server):
    response = httpx.post(f"{server.openai_base_url}/responses", json={"input": "hi"},
                          timeout=30)
    assert response.status_code == 401 and "error" in response.json()


def test_client_disconnect_cancels_the_stream(server):
    body = {"model": MODEL, "input": "Count to a thousand.", "stream": True,
            "max_output_tokens": 2000, "temperature": 0}
    with httpx.stream("POST", f"{server.openai_base_url}/responses", json=body,
                      headers=server.headers(), timeout=60) as response:
        lines = response.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 10
    while server.health()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health()["num_running"] == 0


def test_agents_sdk_runs_a_function_tool(server):
    """One Agent, one function tool, through OpenAIResponsesModel. The first turn
    must call the tool (tool_choice required); the tool's result goes back to the
    model (a second request replaying the call and its output). The tiny model then
    tends to call the tool again rather than answer, so a second call ends the run
    with that tool result as the final output."""
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner,
                        ToolsToFinalOutputResult, function_tool, set_tracing_disabled)

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        cities.append(city)
        return f"22 C and sunny in {city}"

    turns = []

    def stop_on_second_call(context, results):
        turns.append(len(results))
        return ToolsToFinalOutputResult(is_final_output=len(turns) >= 2,
                                        final_output=results[-1].output)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.openai_base_url, api_key=server.api_key,
                                    max_retries=0, timeout=60)
        agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                      tools=[get_weather], tool_use_behavior=stop_on_second_call,
                      model=OpenAIResponsesModel(MODEL, client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0,
                                                   max_tokens=60, parallel_tool_calls=False))
        return await Runner.run(agent, ASK, max_turns=4)

    result = asyncio.run(run())
    assert cities and all(isinstance(city, str) for city in cities)
    assert set(turns) == {1}                   # parallel_tool_calls false: one call a turn
    assert len(result.raw_responses) == len(turns)    # each tool output went back
    assert isinstance(result.final_output, str) and result.final_output.startswith("22 C")


def test_reasoning_becomes_a_reasoning_item():
    """A thinking model's reasoning_content (the chat path's split) is a reasoning
    item before the message, whole and streamed (no thinking model here: the chat
    deltas are given)."""
    message = {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4",
               "tool_calls": []}
    whole = output_items(message, incomplete=False)
    assert [item["type"] for item in whole] == ["reasoning", "message"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "2+2 is 4"}]
    events = ResponseEvents({"id": "resp_x", "output": []})
    sent = events.start()
    for delta in ({"reasoning_content": "2+2 "}, {"reasoning_content": "is 4"},
                  {"content": "4"}):
        sent += events.delta(delta)
    sent += events.finish(False, {"output_tokens": 3})
    payloads = [json.loads(item["data"]) for item in sent]
    kinds = [p["type"] for p in payloads]
    assert kinds.count("response.reasoning_text.delta") == 2
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = payloads[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "2+2 is 4"
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))


def test_failure_mid_stream_is_an_error_then_response_failed():
    from server.edge.errors import OpenAIError

    events = ResponseEvents({"id": "resp_x", "output": []})
    sent = events.start() + events.delta({"content": "Hel"})
    sent += events.fail(OpenAIError("boom", status_code=500, code="generation_failed"))
    payloads = [json.loads(item["data"]) for item in sent]
    assert [p["type"] for p in payloads][-5:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "error", "response.failed"]
    assert payloads[-2]["code"] == "generation_failed" and payloads[-2]["message"] == "boom"
    failed = payloads[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "boom"
    assert failed["output"][0]["status"] == "incomplete"

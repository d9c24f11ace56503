"""The tool-loop workload of bench.serve (`--workload toolloop`): one agent turn
made of two requests, the way an agent framework drives a server.

1. The user's question with a `get_weather` tool, `tool_choice: "required"`: the
   model writes the call (its arguments constrained by the tool's schema).
2. The same chat plus that call and a fixed tool result: the model writes the answer.

Every loop asks the same question, as an agent that runs the same task again does
(a scheduled report, a retry, a test suite): the model's calls and answers repeat,
which suffix decoding proposes from the earlier loops' outputs and prompt lookup
(ngram) can only partly find in the prompt. A loop's output tokens are both
requests' completion tokens; its TTFT is the first request's time to its answer
(unstreamed) and its latency the whole loop's.
"""

from __future__ import annotations

import json
import time

import httpx

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
QUESTION = ("You are a weather assistant. Look up the weather in Lisbon (celsius) and "
            "answer with a detailed forecast for tonight in three paragraphs.")
TOOL_RESULT = json.dumps({"city": "Lisbon", "temperature": 14, "unit": "celsius",
                          "conditions": "light rain", "wind_kmh": 22, "humidity": 81})


async def one_loop(http: httpx.AsyncClient, url: str, body: dict, result_type):
    """One tool loop with `body`'s settings (model, max_tokens, temperature,
    speculative); a `result_type` (bench.serve's RequestResult) for both requests."""
    started = time.perf_counter()
    messages = [{"role": "user", "content": QUESTION}]
    call_body = {**body, "stream": False, "messages": messages, "tools": TOOLS,
                 "tool_choice": "required"}
    try:
        first = await http.post(url, json=call_body)
        if first.status_code != 200:
            return result_type(False, error=f"HTTP {first.status_code}")
        answer = first.json()
        ttft = time.perf_counter() - started
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        if not calls:
            return result_type(False, error="no tool call")
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": TOOL_RESULT}]
        second = await http.post(url, json={**body, "stream": False, "messages": messages})
        if second.status_code != 200:
            return result_type(False, error=f"HTTP {second.status_code}")
        tokens = (answer["usage"]["completion_tokens"]
                  + second.json()["usage"]["completion_tokens"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        return result_type(False, error=type(error).__name__)
    return result_type(True, ttft=ttft, latency=time.perf_counter() - started,
                       output_tokens=tokens)

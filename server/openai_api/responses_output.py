"""The Response object of POST /v1/responses, whole or as a stream builds it.

    {"id": "resp_...", "object": "response", "created_at": ..., "status": "completed",
     "model": ..., "output": [items], "usage": {...}, "error": null,
     "incomplete_details": null, ... the request's parameters echoed ...}

Output items, in the order the model wrote them:

    reasoning      {"type": "reasoning", "id": "rs_...", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ...}]}
    message        {"type": "message", "id": "msg_...", "role": "assistant",
                    "content": [{"type": "output_text", "text": ..., "annotations": []}]}
    function_call  {"type": "function_call", "id": "fc_...", "call_id": "call_...",
                    "name": ..., "arguments": "<JSON text>"}

A plain answer always has its message item (empty text included); an answer that
calls functions has one only when it also wrote text. An answer cut off by the
token limit is "incomplete" with `incomplete_details.reason` "max_output_tokens",
and so is its last item. `output_text` (all the message text joined) is the SDK's
to compute, not a field of the object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..protocol.responses import FunctionTool, NamedFunction, ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def message_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    """`text` None: the item as first announced in a stream, before its content part."""
    content = [] if text is None else [output_text_part(text)]
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": content}


def reasoning_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [reasoning_text_part(text)]
    return {"id": id_, "type": "reasoning", "summary": [], "content": content,
            "status": status}


def function_call_item(id_: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": id_, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def output_items(message: dict[str, Any], incomplete: bool) -> list[dict[str, Any]]:
    """The items of a whole answer, from the chat path's assistant message
    (chat_answer.AnswerShape.message)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(item_id("msg"), message.get("content") or "", "completed"))
    for call in calls:
        items.append(function_call_item(item_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    if incomplete:
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def _text_echo(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text else None
    echoed = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True,
                                                                 exclude_none=True)
    return {"format": echoed, "verbosity": (body.text and body.text.verbosity) or "medium"}


def _tool_choice_echo(choice: Any) -> Any:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def in_progress(body: ResponsesRequest, tools: list[FunctionTool], response_id: str,
                model: str) -> dict[str, Any]:
    """The response before any output: status in_progress, the request's parameters
    echoed with OpenAI's defaults filled in."""
    reasoning = body.reasoning or {}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "background": False, "completed_at": None, "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": None, "model": model,
        "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": body.service_tier or "default", "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": _text_echo(body), "tool_choice": _tool_choice_echo(body.tool_choice),
        "tools": [tool.model_dump() for tool in tools],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user,
        "metadata": body.metadata or {},
    }


def finished(response: dict[str, Any], output: list[dict[str, Any]], incomplete: bool,
             usage_: dict[str, Any]) -> dict[str, Any]:
    """`response` (in_progress) once the answer is over."""
    done = {**response, "output": output, "usage": usage_,
            "status": "incomplete" if incomplete else "completed"}
    if incomplete:
        done["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        done["completed_at"] = int(time.time())
    return done


def failed(response: dict[str, Any], output: list[dict[str, Any]],
           message: str) -> dict[str, Any]:
    """`response` after a failure mid-stream (the error itself went out first)."""
    return {**response, "output": output, "status": "failed",
            "error": {"code": "server_error", "message": message}}

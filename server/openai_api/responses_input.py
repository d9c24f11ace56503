"""A Responses request, translated into the chat path's request.

    instructions                  -> a system message, first
    previous_response_id          -> the stored conversation (responses_store.py) next
    input (a string)              -> one user message
    message items                 -> messages of the same role (parts joined)
    function_call items           -> an assistant message's tool_calls (consecutive
                                     calls, and calls right after an assistant
                                     message, join that message)
    function_call_output items    -> tool messages, by call_id
    reasoning items               -> skipped (templates drop past reasoning)
    tools (flat function tools)   -> chat tools ({"type": "function", "function": {...}})
    tool_choice {"type": "function", "name"} -> {"type": "function", "function": {"name"}}
    text.format                   -> response_format
    max_output_tokens             -> max_completion_tokens

Items and tools are validated one at a time, after the fields they do not know are
dropped (as the chat endpoint drops a message's: agent loops replay output items
with ids, statuses and whatever else the API returned), so that an error names the
item: `input[2].call_id`. From there the request is an ordinary ChatCompletionRequest,
served by the chat path's pieces (rendering, tool formats, grammars, sampling).
"""

from __future__ import annotations

from typing import Any

from ..edge.body import validate_model
from ..edge.errors import OpenAIError, bad_request
from ..edge.lenient_fields import drop_unknown_fields
from ..protocol.chat import ChatCompletionRequest
from ..protocol.responses import (ITEM_TYPES, FunctionCallItem, FunctionCallOutputItem,
                                 FunctionTool, InputItem, MessageItem, NamedFunction,
                                 ResponsesRequest)


def validate_at(model_cls: type, data: dict[str, Any], where: str):
    """`model_cls` validated from `data`, which sits at `where` in the request (e.g.
    "input[2]"); an error names the field below it: "input[2].call_id"."""
    try:
        return validate_model(model_cls, drop_unknown_fields(model_cls, data))
    except OpenAIError as error:
        inner = error.param
        param = f"{where}.{inner}" if inner else where
        message = (error.message.replace(f"'{inner}'", f"'{param}'", 1) if inner
                   else f"Invalid value for '{param}': {error.message}")
        raise bad_request(message, param=param, code=error.code) from None


def input_items(body: ResponsesRequest) -> list[InputItem]:
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    items = []
    for index, raw in enumerate(body.input):
        kind = raw.get("type", "message")
        model_cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model_cls is None:
            raise bad_request(
                f"Invalid value for 'input[{index}].type': {kind!r} is not supported; this "
                f"server takes {', '.join(repr(k) for k in ITEM_TYPES)} items (items cannot "
                "be referred to by id).",
                param=f"input[{index}].type", code="invalid_value")
        items.append(validate_at(model_cls, raw, f"input[{index}]"))
    return items


def function_tools(body: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for index, raw in enumerate(body.tools or []):
        if raw.get("type") != "function":
            raise bad_request(f"Invalid value for 'tools[{index}].type': {raw.get('type')!r}"
                              " tools are not supported; only 'function' tools are.",
                              param=f"tools[{index}].type", code="invalid_value")
        tools.append(validate_at(FunctionTool, raw, f"tools[{index}]"))
    return tools


def chat_messages(instructions: str | None, items: list[InputItem],
                  history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module's table), after `history`
    (a stored response's, as chat messages)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(dict(message) for message in history)
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    if not messages:
        raise bad_request("Invalid value for 'input': it holds no message, function call or "
                          "function call output.", param="input", code="invalid_value")
    return messages


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    if body.text is None or body.text.format is None:
        return None
    fmt = body.text.format
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
              "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                   if v is not None}}


def answer_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items (messages and function calls; reasoning skipped) as
    chat messages, as they would be replayed in `input`."""
    items = [validate_model(ITEM_TYPES[item["type"]],
                            drop_unknown_fields(ITEM_TYPES[item["type"]], item))
             for item in output if item["type"] in ("message", "function_call")]
    return chat_messages(None, items) if items else []


def to_chat_request(body: ResponsesRequest, tools: list[FunctionTool],
                    history: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat request that answers `body` (its tools already validated), after the
    `history` its previous_response_id names."""
    if tools and body.tool_choice != "none" and body.format_type != "text":
        raise bad_request("Invalid value for 'text.format': structured output cannot be "
                          "combined with tools unless tool_choice is 'none'.",
                          param="text.format", code="invalid_value")
    chat: dict[str, Any] = {
        "messages": chat_messages(body.instructions, input_items(body), history),
        "model": body.model, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
        "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": _tool_choice(body.tool_choice),
        "response_format": _response_format(body),
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"},
                                                                    exclude_none=True)}
                  for tool in tools] or None,
    }
    return validate_model(ChatCompletionRequest,
                          {k: v for k, v in chat.items() if v is not None})

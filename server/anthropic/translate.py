"""Anthropic Messages onto the chat path: a MessagesRequest becomes the
ChatCompletionRequest the chat route would get for the same conversation, so the
template, tool formats, grammars, reasoning and sampling are chat's.

    system                     -> a system message
    user text blocks           -> a user message
    user tool_result blocks    -> tool messages (tool_call_id = tool_use_id), first
    assistant text             -> assistant content
    assistant tool_use blocks  -> assistant tool_calls (arguments: the input as JSON)
    tools[].input_schema       -> tools[].function.parameters
    tool_choice auto/any/tool/none -> auto/required/{"function": name}/none
    disable_parallel_tool_use  -> parallel_tool_calls: false
    stop_sequences             -> stop
    thinking enabled/disabled  -> chat_template_kwargs.enable_thinking

A tool result marked `is_error` reaches the model prefixed "Error: ".
"""

from __future__ import annotations

import json
from typing import Any

from ..edge.body import validate_model
from ..protocol.chat import ChatCompletionRequest
from .protocol import (CountTokensRequest, Message, MessagesRequest, TextBlock, ThinkingBlock,
                       ToolResultBlock, ToolUseBlock)


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            "parameters": tool.input_schema}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice.type, choice.name)
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        chat.update({key: value for key, value in (
            ("max_tokens", body.max_tokens), ("stop", body.stop_sequences),
            ("temperature", body.temperature), ("top_p", body.top_p), ("top_k", body.top_k),
            ("stream", body.stream), ("speculative", body.speculative)) if value is not None})
    return validate_model(ChatCompletionRequest, chat)


def _tool_choice(kind: str, name: str | None) -> Any:
    if kind == "tool":
        return {"type": "function", "function": {"name": name or ""}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else \
            "".join(block.text for block in body.system)
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages.extend(_user(message) if message.role == "user" else _assistant(message))
    return messages


def _user(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out = [{"role": "tool", "tool_call_id": block.tool_use_id,
            "content": ("Error: " if block.is_error else "") + block.text}
           for block in message.content if isinstance(block, ToolResultBlock)]
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _assistant(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "assistant", "content": message.content}]
    text = "".join(block.text for block in message.content if isinstance(block, TextBlock))
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input)}}
             for block in message.content if isinstance(block, ToolUseBlock)]
    assistant: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        assistant["tool_calls"] = calls
    elif not text and all(isinstance(b, ThinkingBlock) for b in message.content):
        assistant["content"] = ""
    return [assistant]

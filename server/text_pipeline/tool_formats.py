"""How a model is told about tools and how its calls are read back, per template family.

    generic      templates that know nothing of tools (the default model's): the tools
                 are described in a system message and the whole answer is a JSON
                 envelope, {"tool_calls": [{"name", "arguments"}]} or {"content": text},
                 always constrained by a grammar (so even `auto` answers parse)
    hermes       <tool_call>{"name", "arguments"}</tool_call> blocks (Qwen2.5, Qwen3,
                 Hermes): the template renders the tools itself
    llama3_json  a bare {"name", "parameters"} object (Llama 3.1+ JSON calls)
    mistral      [TOOL_CALLS][{"name", "arguments"}, ...]

The family is chosen once, from the chat template's text (`detect_format`), unless
`--tool-parser` names one. Every family constrains calls with a grammar: under
`required` or a named `tool_choice` the answer is calls only, under `auto` the model
may answer in text, but once it starts a call the call is constrained, so the
arguments always parse and match the function's schema (Mistral's `auto` excepted:
free, then parsed).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine.structured.grammar import GrammarSpec

from ..protocol.chat import NamedToolChoice, Tool

TOOL_FORMATS = ("generic", "hermes", "llama3_json", "mistral")
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments as JSON text (what OpenAI's `function.arguments` holds)."""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


def detect_format(chat_template: str | None) -> str:
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "generic"


def call_schema(tools: list[Tool], choice, arguments_key: str = "arguments") -> dict:
    """One call's schema: any offered function (or the named one) with its arguments."""
    chosen = [t for t in tools if not isinstance(choice, NamedToolChoice)
              or t.function.name == choice.function.name]
    options = [{"type": "object", "additionalProperties": False,
                "required": ["name", arguments_key],
                "properties": {"name": {"const": t.function.name},
                               arguments_key: _closed(t.function.parameters_schema)}}
               for t in chosen]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _closed(schema: dict) -> dict:
    """Arguments with only the declared properties, unless the schema says otherwise:
    still valid against it, and what OpenAI's strict mode requires anyway."""
    if schema.get("type") == "object" and "additionalProperties" not in schema \
            and schema.get("properties"):
        return {**schema, "additionalProperties": False}
    return schema


def calls_schema(tools: list[Tool], choice, parallel: bool) -> dict:
    bound = {"maxItems": 1} if not parallel or isinstance(choice, NamedToolChoice) else {}
    return {"type": "array", "items": call_schema(tools, choice), "minItems": 1, **bound}


def _call_from(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return ParsedCall(value["name"], text)


class GenericFormat:
    name = "generic"

    def prepare(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], dict]:
        described = [{"name": t.function.name, "description": t.function.description or "",
                      "parameters": t.function.parameters_schema} for t in tools]
        guide = ("You can call functions. To call one or more, answer with only a JSON "
                 'object {"tool_calls": [{"name": <function name>, "arguments": <arguments '
                 'object>}]}. To answer without calling a function, answer with only '
                 '{"content": <your answer>}. Functions:\n' + json.dumps(described))
        rendered = [self._message(m) for m in messages]
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + guide}
        else:
            rendered.insert(0, {"role": "system", "content": guide})
        return rendered, {}

    @staticmethod
    def _message(message: dict) -> dict:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            return {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
        if message["role"] == "assistant":
            return {"role": "assistant", "content": json.dumps({"content": message["content"]})}
        if message["role"] == "tool":          # any template knows the user role
            return {"role": "user", "content": f"Result of call {message.get('tool_call_id')}:"
                                               f" {message['content']}"}
        return message

    def grammar(self, tools: list[Tool], choice, parallel: bool) -> GrammarSpec:
        calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                 "properties": {"tool_calls": calls_schema(tools, choice, parallel)}}
        if choice == "required" or isinstance(choice, NamedToolChoice):
            return GrammarSpec("json_schema", calls)
        text = {"type": "object", "additionalProperties": False, "required": ["content"],
                "properties": {"content": {"type": "string"}}}
        return GrammarSpec("json_schema", {"anyOf": [calls, text]})

    def parse(self, text: str) -> ParsedOutput:
        try:
            value = json.loads(text)
        except ValueError:
            return ParsedOutput(text, [])
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            calls = [c for c in map(_call_from, value["tool_calls"]) if c is not None]
            if calls:
                return ParsedOutput(None, calls)
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            return ParsedOutput(value["content"], [])
        return ParsedOutput(text, [])


class TemplateFormat:
    """The families whose template renders the tools: the messages go as they are,
    the tools as the template's `tools` argument."""

    name = ""

    def prepare(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], dict]:
        return messages, {"tools": [t.model_dump(exclude_none=True) for t in tools]}


class HermesFormat(TemplateFormat):
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def grammar(self, tools: list[Tool], choice, parallel: bool) -> GrammarSpec:
        """`required`/named: calls only. `auto`: free text that never spells
        <tool_call>, or text up to the first <tool_call> and then calls only, so a
        started call is always valid."""
        schema = json.dumps({**call_schema(tools, choice), **_COMPACT})
        single = not parallel or isinstance(choice, NamedToolChoice)
        more = "" if single else "more*"
        rules = (f'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
                 f'more: /[ \\n]*/ call\nbody: %json {schema}\n')
        if choice == "auto":
            return GrammarSpec("lark", f'start: PLAIN | lead call_rest {more}\n'
                                       'PLAIN: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n'
                                       'lead[stop="<tool_call>"]: /(?s:.*)/\n'
                                       'call_rest: "\\n" body "\\n</tool_call>"\n' + rules)
        return GrammarSpec("lark", f"start: call {more}\n" + rules)

    def parse(self, text: str) -> ParsedOutput:
        calls, kept, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            try:
                call = _call_from(json.loads(match.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue
            kept.append(text[last:match.start()])
            last = match.end()
            calls.append(call)
        kept.append(text[last:])
        content = "".join(kept).strip() if calls else text
        return ParsedOutput(content or None, calls)


class Llama3JsonFormat(TemplateFormat):
    name = "llama3_json"

    def grammar(self, tools: list[Tool], choice, parallel: bool) -> GrammarSpec:
        """A call is the whole answer: `auto` allows text that does not start
        with `{` instead."""
        schema = call_schema(tools, choice, "parameters")
        if choice != "auto":
            return GrammarSpec("json_schema", schema)
        body = json.dumps({**schema, **_COMPACT})
        return GrammarSpec("lark", f"start: TEXT | body\nTEXT: /[^{{](?s:.*)/\n"
                                   f"body: %json {body}\n")

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_tag|>")
        calls = []
        for part in body.split(";") if body.startswith("{") else []:
            try:
                call = _call_from(json.loads(part), "parameters")
            except ValueError:
                return ParsedOutput(text, [])
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])


class MistralFormat(TemplateFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def grammar(self, tools: list[Tool], choice, parallel: bool) -> GrammarSpec | None:
        """`required`/named only: under `auto` the answer is free and parsed. (A text
        rule that stops at the marker would drop bytes of a token spanning it, as
        `][` is one token in many vocabularies; Mistral's own marker is one special
        token, which a Lark rule cannot stop on.)"""
        if choice == "auto":
            return None
        schema = json.dumps({**calls_schema(tools, choice, parallel), **_COMPACT})
        return GrammarSpec("lark", f'start: "{self.marker}" body\nbody: %json {schema}\n')

    def parse(self, text: str) -> ParsedOutput:
        head, marker, tail = text.partition(self.marker)
        if not marker:
            return ParsedOutput(text, [])
        try:
            values = json.loads(tail)
        except ValueError:
            return ParsedOutput(text, [])
        calls = [c for c in map(_call_from, values if isinstance(values, list) else [])
                 if c is not None]
        return ParsedOutput(head.strip() or None, calls) if calls else ParsedOutput(text, [])


def tool_format(name: str):
    formats = {f.name: f for f in (GenericFormat(), HermesFormat(), Llama3JsonFormat(),
                                   MistralFormat())}
    return formats[name]

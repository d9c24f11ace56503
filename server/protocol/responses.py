"""Schema of POST /v1/responses (OpenAI's Responses API), served statelessly.

The request's conversation is `input`: a string (one user message) or a list of
items, each validated on its own (`ITEM_TYPES`) so that an error names it, e.g.
`input[2].call_id`:

    message               {"role": "user" | "system" | "developer" | "assistant",
                           "content": str | [{"type": "input_text" | "output_text",
                                              "text": ...}, ...]}
                          (`"type": "message"` may be left out)
    function_call         a call the model made in an earlier turn: call_id, name,
                          arguments (JSON text)
    function_call_output  the caller's result of one: call_id, output
    reasoning             an earlier turn's reasoning, sent back by agent loops; the
                          chat template drops reasoning anyway, so it is skipped

Tools are OpenAI's flat function tools (`{"type": "function", "name", "parameters",
...}`, not nested under "function"); `text.format` is the structured-output switch
(`text`, `json_object`, `json_schema` with `name` and `schema`). `reasoning` is
accepted and its effort ignored.

Responses are stored unless `store` is false (server/openai_api/responses_store.py), and
`previous_response_id` continues one. `conversation` (OpenAI's conversation objects),
`background` and `prompt` (stored prompt templates) are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import OpenAIModel
from .chat import join_text_parts

_FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_NO_CONVERSATIONS = ("conversation objects are not supported by this server; continue with "
                     "'previous_response_id' or send the whole conversation in 'input'")
_NO_PROMPTS = ("stored prompt templates are not supported by this server; send 'instructions' "
               "and 'input' instead")


def join_input_parts(value: Any) -> str:
    """A message's or a tool output's content as one string: a string as is, text
    parts concatenated. The keys a replayed output part carries besides its text
    (annotations, logprobs) are ignored; image, file and audio parts are refused."""
    return join_text_parts(value, _TEXT_PART_TYPES, strict_fields=False)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join(cls, value: Any) -> str:
        return join_input_parts(value)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _join(cls, value: Any) -> str:
        return join_input_parts(value)


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type[OpenAIModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "TextFormat":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs 'name' and 'schema'")
        if self.type != "json_schema" and (self.name or self.schema_ is not None):
            raise ValueError("'name' and 'schema' are only allowed with type 'json_schema'")
        return self


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(OpenAIModel):
    input: str | list[dict[str, Any]]
    """Items are validated one by one afterwards (responses_input.py)."""
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    """Validated one by one as FunctionTool afterwards, like the input items."""
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None

    @field_validator("conversation")
    @classmethod
    def _refuse_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(_NO_CONVERSATIONS)
        return value

    @field_validator("prompt")
    @classmethod
    def _refuse_prompt(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(_NO_PROMPTS)
        return value

    @field_validator("background")
    @classmethod
    def _refuse_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        if not value:
            raise ValueError("must hold at least one item")
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                raise ValueError(f"item {index} must be an object")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> "ResponsesRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def format_type(self) -> str:
        """text, json_object or json_schema."""
        return self.text.format.type if self.text and self.text.format else "text"

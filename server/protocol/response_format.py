"""Schema of `response_format` (chat and text completions).

    {"type": "text"}                                  free text (the default)
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
                                            "strict": true, "description": ...}}

The OpenAI SDK's `chat.completions.parse(response_format=Model)` sends the last form
with pydantic's schema of `Model`. A schema the grammar library cannot use is a 400
naming the part (server/text_pipeline/structured_output.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .base import OpenAIModel


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("'json_schema' is only allowed with type 'json_schema'")
        return self

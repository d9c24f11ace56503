"""Reading a request body into a validated pydantic model, OpenAI-style.

Routes parse their own bodies (instead of letting FastAPI do it) so that each way a
body can be wrong maps to one clear error:

    too many bytes               -> 413
    not JSON, NaN / Infinity     -> 400 "invalid JSON"
    JSON but not an object       -> 400
    schema violation             -> 400 naming the offending field, e.g. messages[0].role

Strings are cleaned on the way in: a lone UTF-16 surrogate (legal in JSON's `\\ud800`
escapes, illegal in UTF-8) would crash the tokenizer or the JSON encoder of an error
message, so each one becomes U+FFFD. NUL and other control characters are valid text
and pass through unchanged.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .errors import OpenAIError, bad_request, format_loc
from .lenient_fields import drop_unknown_fields

ModelT = TypeVar("ModelT", bound=BaseModel)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refusing (413) as soon as it grows past `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(f"Request body is larger than the limit of {max_bytes} bytes.",
                       status_code=413, code="request_too_large")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON: no NaN/Infinity, finite numbers, a top-level object."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        if not isinstance(value, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        return sanitize_strings(value)
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"Invalid JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("Invalid JSON body: nested too deeply.", code="invalid_json") from None


def sanitize_strings(value: Any) -> Any:
    """Replace lone surrogates in every string (keys included) with U+FFFD."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [sanitize_strings(v) for v in value]
    if isinstance(value, dict):
        return {sanitize_strings(k): sanitize_strings(v) for k, v in value.items()}
    return value


def validate_model(model_cls: type[ModelT], data: dict[str, Any]) -> ModelT:
    """`model_cls.model_validate(data)`, with the first error turned into a 400."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_openai(exc) from None


def validation_error_to_openai(exc: ValidationError) -> OpenAIError:
    first = exc.errors(include_url=False, include_input=False)[0]
    param = format_loc(tuple(first["loc"])) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unsupported parameter: '{param}' is not supported by this server.",
                           param=param, code="unsupported_parameter")
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    message = first["msg"]
    # Errors raised by our own validators read "Value error, <text>": keep the text.
    message = message.removeprefix("Value error, ")
    return bad_request(f"Invalid value for '{param}': {message}" if param else message,
                       param=param, code="invalid_value")


async def parse_request(request: Request, model_cls: type[ModelT], max_bytes: int, *,
                        ignore_unknown: bool = False,
                        message_cls: type[BaseModel] | None = None) -> ModelT:
    """Body -> JSON object -> `model_cls`, each step with its own error. With
    `ignore_unknown` (the generation endpoints), fields neither `model_cls` nor, per
    message, `message_cls` knows are dropped first (lenient_fields.py)."""
    raw = await read_body(request, max_bytes)
    data = parse_json_object(raw)
    if ignore_unknown:
        data = drop_unknown_fields(model_cls, data, message_cls)
    return validate_model(model_cls, data)

"""Errors in Anthropic's shape, for the /v1/messages routes:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

The same failures as elsewhere (OpenAIError), with Anthropic's type names by status.
"""

from __future__ import annotations

from typing import Any

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

MESSAGES_PREFIX = "/v1/messages"
"""The paths whose errors take this shape."""


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    kind = _TYPE_BY_STATUS.get(status_code, "invalid_request_error" if status_code < 500
                               else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}

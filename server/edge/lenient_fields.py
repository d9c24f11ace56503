"""Fields real clients send that this server does not use.

SDKs and agent frameworks add fields that do not change the output (`metadata`,
`store`, `service_tier`, an `id` on a replayed message, ...). Refusing them would
break those clients on their first call, so on the generation endpoints unknown
top-level keys and unknown keys of a message are dropped before validation and
logged once per field name (a log line per request would flood the log).

Fields that would change the output and are not supported stay in the body, so
validation answers 400 naming them: audio output, predicted outputs, web search, the
legacy `functions` / `function_call` (use `tools`), and the completions API's `suffix`
(fill-in-the-middle) and `best_of`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

REFUSED_FIELDS = frozenset({"audio", "prediction", "web_search_options", "functions",
                            "function_call", "suffix", "best_of"})
"""Top-level fields that would change the output: a 400 naming them."""

_logged: set[str] = set()
_logged_lock = threading.Lock()


def _known(model_cls: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model_cls.model_fields.items()}


def _log_once(where: str, names: list[str]) -> None:
    with _logged_lock:
        new = [n for n in names if f"{where}.{n}" not in _logged]
        _logged.update(f"{where}.{n}" for n in new)
    if new:
        logger.info("ignoring unsupported field(s) of %s: %s (logged once)", where,
                    ", ".join(sorted(new)))


def drop_unknown_fields(model_cls: type[BaseModel], data: dict[str, Any],
                        message_cls: type[BaseModel] | None = None) -> dict[str, Any]:
    """`data` without the keys `model_cls` (and, for each of `data["messages"]`,
    `message_cls`) does not know, except REFUSED_FIELDS and a `modalities` that asks
    for more than text."""
    known = _known(model_cls)
    unknown = [k for k in data if k not in known and k not in REFUSED_FIELDS
               and not (k == "modalities" and data[k] not in (["text"], None))]
    if unknown:
        _log_once(model_cls.__name__, unknown)
        data = {k: v for k, v in data.items() if k not in unknown}
    messages = data.get("messages")
    if message_cls is not None and isinstance(messages, list):
        message_known = _known(message_cls)
        cleaned = []
        for message in messages:
            if isinstance(message, dict):
                extra = [k for k in message if k not in message_known]
                if extra:
                    _log_once(message_cls.__name__, extra)
                    message = {k: v for k, v in message.items() if k not in extra}
            cleaned.append(message)
        data = {**data, "messages": cleaned}
    return data

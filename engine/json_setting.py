"""Settings given as a JSON object: `--speculative-config '{"method": "ngram"}'`,
`--kv-events-config '{...}'`, the same text in an environment variable or the YAML
file, or a dict from Python. One reading for all of them, so each says its errors the
same way, naming the setting."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def json_setting_fields(value: Any, config_type: type, name: str) -> Any:
    """`value` as a dict of `config_type`'s fields (checked: an object, no unknown
    keys), or returned as it is when it is None or already a `config_type`; None for
    "" and "null" (the setting off). ValueError naming `name` otherwise."""
    if value is None or isinstance(value, config_type):
        return value
    if isinstance(value, str):
        if value.strip() in ("", "null"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    known = {field.name for field in fields(config_type)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return value

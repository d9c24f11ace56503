"""Server settings from the environment: one `KVSERVE_<FIELD>` variable per field.

The variables are derived from the settings' fields, so a new field gets its
variable with no edit here: `port` <-> KVSERVE_PORT, `max_batch_tokens` <->
KVSERVE_MAX_BATCH_TOKENS, `request_timeout_s` <-> KVSERVE_REQUEST_TIMEOUT_S.
Precedence (settings.py): defaults < the `--config` file < the environment <
command-line flags, so a container or a systemd unit can set anything without a
file and a flag typed by hand still wins.

A value is text, converted by its field's type:

- int and float fields: Python's literals (`8000`, `0.9`, `1e3`);
- bool fields: 1/0, true/false, yes/no, on/off, in any case;
- list fields: comma-separated, each item stripped, empty items dropped
  (`KVSERVE_API_KEY=key1,key2`, `KVSERVE_CORS_ALLOW_ORIGINS=http://a,http://b`);
- str fields and fields of fixed choices (dtype, scheduler, ...): as written; the
  settings model checks the choice;
- `none` or `null`, in any case: the empty list for a list field
  (`KVSERVE_OPEN_PATHS=none`: every route needs a key; `KVSERVE_API_KEY=none` is
  refused, never an open API), None for another field that may be None
  (`KVSERVE_REQUEST_TIMEOUT_S=none` lifts a limit the file sets). For any other
  field the word is an ordinary value: a bad port, a model path.
- an empty value (spaces and commas only, for a list) counts as unset: the file's
  value or the default stands. It is what a compose file's `${VAR:-}` passes for a
  variable the shell does not set, and `KVSERVE_API_KEY=` has always meant "no keys".

A value that does not convert raises EnvValueError naming the variable.
A `KVSERVE_*` variable that is no setting's is logged as a warning naming it, with
the nearest setting's variable when one is close (a typo such as
KVSERVE_MAX_BATCH_TOKEN). The engine's own switches (OTHER_VARIABLES) are not
warned about. KVSERVE_CONFIG is not read: the config file comes only from
`--config`, and a warning says so rather than letting the file be silently skipped.
"""

from __future__ import annotations

import difflib
import logging
import types
from typing import Any, Iterable, Literal, Mapping, Union, get_args, get_origin

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVSERVE_"
NONE_WORDS = ("none", "null")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# KVSERVE_ variables that are not server settings, read where they act.
OTHER_VARIABLES = {
    "KVSERVE_AMX": "engine/kernels/native.py: 0 keeps bf16 matmuls off AMX tiles",
    "KVSERVE_NATIVE_KERNELS": "engine/kernels/build.py: 0 turns the native kernels off",
}
CONFIG_VARIABLE = "KVSERVE_CONFIG"
_UNSET = object()   # convert()'s answer for a list of nothing but separators


class EnvValueError(ValueError):
    """A variable's text is not a value of its field's type."""

    def __init__(self, field: str, variable: str, reason: str):
        super().__init__(f"{variable}: {reason}")
        self.field, self.variable, self.reason = field, variable, reason


def env_name(field: str) -> str:
    """The variable of a settings field: KVSERVE_ and the name in capitals."""
    return ENV_PREFIX + field.upper()


def env_table(fields: Iterable[str]) -> dict[str, str]:
    """Variable -> field, for every field."""
    return {env_name(field): field for field in fields}


def read_environment(fields: Mapping[str, Any],
                     environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings set in `environ`, converted: field -> value.

    `fields` maps each field name to its pydantic FieldInfo (only `.annotation` is
    read). Unknown KVSERVE_ variables are logged as warnings (unknown_variables)."""
    values: dict[str, Any] = {}
    for variable, field in env_table(fields).items():
        text = environ.get(variable)
        if text is None or not text.strip():
            continue
        try:
            value = convert(fields[field].annotation, text)
        except ValueError as exc:
            raise EnvValueError(field, variable, str(exc)) from None
        if value is not _UNSET:
            values[field] = value
    for message in unknown_variables(environ, fields):
        logger.warning(message)
    return values


def unknown_variables(environ: Mapping[str, str], fields: Iterable[str]) -> list[str]:
    """A warning for each KVSERVE_ variable in `environ` that nothing reads."""
    table = env_table(fields)
    settings_names = [name.removeprefix(ENV_PREFIX) for name in table]
    messages = []
    for variable in sorted(environ):
        if (not variable.startswith(ENV_PREFIX) or variable in table
                or variable in OTHER_VARIABLES):
            continue
        if variable == CONFIG_VARIABLE:
            messages.append(f"{CONFIG_VARIABLE} is not read: pass the config file with "
                            f"--config")
            continue
        near = difflib.get_close_matches(variable.removeprefix(ENV_PREFIX), settings_names,
                                         n=1, cutoff=0.75)
        hint = f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""
        messages.append(f"ignoring unknown environment variable {variable}: it names "
                        f"no setting{hint}")
    return messages


def convert(annotation: Any, text: str) -> Any:
    """`text` as a value of the type `annotation` (see the module docstring).

    Raises ValueError saying what was expected, TypeError for a type no rule
    covers (a new kind of field: add its rule here)."""
    base, optional = _without_none(annotation)
    stripped = text.strip()
    is_list = get_origin(base) is list
    if stripped.lower() in NONE_WORDS and (optional or is_list):
        return [] if is_list else None
    if base is bool:
        return _boolean(stripped)
    if base is int:
        try:
            return int(stripped)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if base is float:
        try:
            return float(stripped)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if is_list and get_args(base) == (str,):
        items = [item.strip() for item in text.split(",")]
        return [item for item in items if item] or _UNSET
    if base is str or (get_origin(base) is Literal
                       and all(isinstance(choice, str) for choice in get_args(base))):
        return text
    raise TypeError(f"no rule reads a {annotation!r} setting from the environment")


def _without_none(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed): `int | None` -> (int, True)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(annotation))
    return annotation, False


def _boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {'/'.join(TRUE_WORDS)} or "
                     f"{'/'.join(FALSE_WORDS)}, got {text!r}")

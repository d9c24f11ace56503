"""Every setting from a KVSERVE_<FIELD> variable: each field lands, the precedence
file < environment < flag holds, text converts by type, and a bad or unknown
variable is named."""

import logging
import os
import re
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import pytest

from server.__main__ import main
from server.cli import build_parser, parse_settings
from server.settings import ServerSettings, SettingsError, build_settings, env_values
from server.settings_env import OTHER_VARIABLES, env_name, env_table, unknown_variables

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ServerSettings.model_fields


def sample(name: str) -> tuple[str, object]:
    """(a variable's text, the value it must give) for field `name`: valid, and not
    the default, so a field the environment fails to set shows."""
    field = FIELDS[name]
    if name == "speculative_config":             # text the setting checks as JSON
        text = '{"method": "ngram", "num_speculative_tokens": 3}'
        return text, text
    if name == "kv_events_config":               # (JSON too)
        text = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
        return text, text
    annotation, default = field.annotation, field.get_default(call_default_factory=True)
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if annotation is bool:
        value = True if default is None else not default
        return ("yes" if value else "off"), value
    if annotation is int:
        value = 8 if default is None else default + 1
        for bound in field.metadata:
            value = min(value, getattr(bound, "le", value))
        return f" {value} ", value
    if annotation is float:
        value = 0.5 if default is None else default + 1.5
        return str(value), value
    if get_origin(annotation) is Literal:
        value = [choice for choice in get_args(annotation) if choice != default][-1]
        return value, value
    if get_origin(annotation) is list:
        return "/one, /two,", ["/one", "/two"]
    if annotation is str:
        return f"x-{name}", f"x-{name}"
    raise AssertionError(f"no sample for {name}: {field.annotation}; teach settings_env")


def test_every_field_lands_from_its_variable():
    samples = {name: sample(name) for name in FIELDS}
    environ = {env_name(name): text for name, (text, _) in samples.items()}
    assert len(environ) == len(FIELDS) >= 30
    settings = build_settings({}, {}, environ)
    defaults = ServerSettings()
    for name, (_, value) in samples.items():
        assert value != getattr(defaults, name), name
        assert getattr(settings, name) == value, name
    assert env_values(environ).keys() == FIELDS.keys()


def test_variable_names_are_the_fields_in_capitals():
    table = env_table(FIELDS)
    assert len(table) == len(FIELDS)
    for variable in ("KVSERVE_MODEL", "KVSERVE_DTYPE", "KVSERVE_MAX_BATCH_TOKENS",
                     "KVSERVE_REQUEST_TIMEOUT_S", "KVSERVE_API_KEY", "KVSERVE_PORT"):
        assert table[variable] == variable.removeprefix("KVSERVE_").lower()


def test_file_then_environment_then_flag(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9000\ndtype: float32\nmax_queue_size: 5\napi_key: [file-key]\n")
    environ = {"KVSERVE_PORT": "9100", "KVSERVE_DTYPE": "bfloat16",
               "KVSERVE_API_KEY": "env-1,env-2", "KVSERVE_LOG_LEVEL": "debug"}
    from_env = parse_settings(["--config", str(config)], environ=environ)
    assert (from_env.port, from_env.dtype, from_env.log_level) == (9100, "bfloat16", "debug")
    assert from_env.max_queue_size == 5 and from_env.api_key == ["env-1", "env-2"]
    flags = ["--config", str(config), "--port", "9200", "--api-key", "flag-key"]
    from_flag = parse_settings(flags, environ=environ)
    assert (from_flag.port, from_flag.api_key, from_flag.dtype) == (9200, ["flag-key"], "bfloat16")
    assert parse_settings(["--config", str(config)], environ={}).port == 9000


@pytest.mark.parametrize("text, value", [
    *[(word, True) for word in ("1", "true", "TRUE", "yes", "On")],
    *[(word, False) for word in ("0", "false", "No", "off", "OFF")],
])
def test_booleans(text, value):
    assert build_settings({}, {}, {"KVSERVE_LOG_PROMPTS": text}).log_prompts is value
    assert build_settings({}, {}, {"KVSERVE_ALLOW_BLOCK_SHARING": text}).allow_block_sharing is value


def test_lists_none_and_empty_values():
    file_values = {"request_timeout_s": 60.0, "open_paths": ["/health"], "gguf_file": "a.gguf"}
    env = {"KVSERVE_CORS_ALLOW_ORIGINS": " http://a , ,http://b ",
           "KVSERVE_REQUEST_TIMEOUT_S": "none", "KVSERVE_OPEN_PATHS": "NULL",
           "KVSERVE_GGUF_FILE": "None", "KVSERVE_MODEL": "none"}
    settings = build_settings(file_values, {}, env)
    assert settings.cors_allow_origins == ["http://a", "http://b"]
    assert settings.request_timeout_s is None and settings.gguf_file is None
    assert settings.open_paths == []            # a list's `none` is the empty list
    assert settings.model == "none"             # a plain string keeps the word
    unset = {"KVSERVE_REQUEST_TIMEOUT_S": "", "KVSERVE_OPEN_PATHS": " , ",
             "KVSERVE_API_KEY": ""}             # empty: the file's value stands
    settings = build_settings(file_values, {}, unset)
    assert settings.request_timeout_s == 60.0 and settings.open_paths == ["/health"]
    assert settings.api_key is None


@pytest.mark.parametrize("variable, text, field", [
    ("KVSERVE_PORT", "eighty", "port"),
    ("KVSERVE_PORT", "70000", "port"),
    ("KVSERVE_TP_SIZE", "1.5", "tp_size"),
    ("KVSERVE_REQUEST_TIMEOUT_S", "soon", "request_timeout_s"),
    ("KVSERVE_REQUEST_TIMEOUT_S", "-1", "request_timeout_s"),
    ("KVSERVE_LOG_PROMPTS", "maybe", "log_prompts"),
    ("KVSERVE_DTYPE", "float8", "dtype"),
    ("KVSERVE_SCHEDULER", "lifo", "scheduler"),
    ("KVSERVE_PAGE_SIZE", "2", "page_size"),              # the engine's own check
    ("KVSERVE_MAX_MEMORY_PERCENT", "1.5", "max_memory_percent"),
    ("KVSERVE_API_KEY", "none", "api_key"),               # never an open API
])
def test_bad_values_name_the_variable(variable, text, field):
    with pytest.raises(SettingsError, match=f"^invalid setting '{field}' from {variable}: "):
        build_settings({}, {}, {variable: text})


def test_main_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_MAX_BATCH_TOKENS", "lots")
    assert main([]) == 2
    assert "'max_batch_tokens' from KVSERVE_MAX_BATCH_TOKENS" in capsys.readouterr().err


def test_unknown_variables_are_warned_about(caplog):
    environ = {"KVSERVE_MAX_BATCH_TOKEN": "512", "KVSERVE_CONFIG": "x.yaml",
               "KVSERVE_COLOUR": "blue", "KVSERVE_AMX": "0", "HF_TOKEN": "hf_x",
               "KVSERVE_PORT": "9000"}
    with caplog.at_level(logging.WARNING, logger="server.settings_env"):
        assert build_settings({}, {}, environ).port == 9000
    text = caplog.text
    assert "KVSERVE_MAX_BATCH_TOKEN:" in text and "did you mean KVSERVE_MAX_BATCH_TOKENS?" in text
    assert "KVSERVE_CONFIG is not read" in text and "KVSERVE_COLOUR" in text
    assert "KVSERVE_AMX" not in text and "HF_TOKEN" not in text
    assert len(caplog.records) == 3


def test_every_kvserve_variable_read_in_the_code_is_known():
    """A variable some module reads is a setting's or listed as another part's, so
    the unknown-variable warning never fires for one that works."""
    pattern = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](KVSERVE_\w+)""")
    read = {name for folder in ("engine", "server") for path in (ROOT / folder).rglob("*.py")
            for name in pattern.findall(path.read_text(encoding="utf-8"))}
    assert {"KVSERVE_AMX", "KVSERVE_NATIVE_KERNELS"} <= read
    assert unknown_variables(dict.fromkeys(read, "1"), FIELDS) == []
    assert set(OTHER_VARIABLES) <= read


def test_the_environment_is_read_not_changed(monkeypatch):
    """HF_TOKEN (read by the hub client itself) and the rest pass through untouched."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("KVSERVE_PORT", "9001")
    before = dict(os.environ)
    assert parse_settings([]).port == 9001
    assert dict(os.environ) == before and os.environ["HF_TOKEN"] == "hf_secret"


def test_help_names_each_flags_variable():
    parser = build_parser()
    settings_actions = [a for a in parser._actions if a.dest in FIELDS]
    assert {a.dest for a in settings_actions} == set(FIELDS)
    for action in settings_actions:
        assert f"[env {env_name(action.dest)}" in action.help, action.dest
    text = parser.format_help()
    assert "KVSERVE_PORT" in text and "KVSERVE_REQUEST_TIMEOUT_S" in text
    assert "the environment, flags" in " ".join(text.split())

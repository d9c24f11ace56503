"""CLI and YAML settings: precedence, and errors that name the field."""

from pathlib import Path

import pytest
import yaml

from server.__main__ import main
from server.cli import parse_settings
from server.settings import ServerSettings, SettingsError

DEFAULT_YAML = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def test_default_yaml_matches_built_in_defaults():
    file_values = yaml.safe_load(DEFAULT_YAML.read_text())
    assert set(file_values) == set(ServerSettings.model_fields)
    assert parse_settings(["--config", str(DEFAULT_YAML)], environ={}) == ServerSettings()


def test_cli_overrides_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9000\npage_size: 32\nscheduler: prefill_first\n")
    settings = parse_settings(["--config", str(config), "--port", "9100"])
    assert (settings.port, settings.page_size, settings.scheduler) == (9100, 32, "prefill_first")
    engine_config = settings.continuous_batching_config()
    assert (engine_config.page_size, engine_config.scheduler_type) == (32, "prefill_first")
    compiled = parse_settings(["--config", str(config), "--compile-level", "2"])
    assert compiled.continuous_batching_config().default_compile_level == 2


@pytest.mark.parametrize("text, field", [
    ("pagesize: 32\n", "pagesize"),
    ("page_size: 2\n", "page_size"),
    ("port: eighty\n", "port"),
    ("max_memory_percent: 1.5\n", "max_memory_percent"),
    ("scheduler: lifo\n", "scheduler"),
    ("dtype: float8\n", "dtype"),
    ("compile_level: 4\n", "compile_level"),
    ("kv_events_config: '{\"publisher\": \"kafka\"}'\n", "kv_events_config"),
])
def test_bad_file_fields_are_named(tmp_path, text, field):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=f"'{field}'"):
        parse_settings(["--config", str(config)])


def test_bad_cli_value_is_named():
    with pytest.raises(SettingsError, match="'num_blocks'"):
        parse_settings(["--num-blocks", "0"])


def test_config_file_must_be_a_mapping(tmp_path):
    config = tmp_path / "list.yaml"
    config.write_text("- 1\n- 2\n")
    with pytest.raises(SettingsError, match="mapping"):
        parse_settings(["--config", str(config)])


def test_main_exits_2_with_the_field_name(capsys):
    assert main(["--page-size", "3"]) == 2
    assert "page_size" in capsys.readouterr().err


def test_main_exits_1_when_the_model_cannot_load(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["--model", str(missing), "--log-level", "error"]) == 1
    assert "cannot load model" in capsys.readouterr().err


def test_the_server_steps_2048_tokens_on_cpu_unless_told():
    from server.app import CPU_MAX_BATCH_TOKENS, engine_config

    default = parse_settings([], environ={})
    assert engine_config(default, "cpu").max_batch_tokens == CPU_MAX_BATCH_TOKENS == 2048
    assert engine_config(default, "cuda").max_batch_tokens is None      # the engine's 8192
    told = parse_settings(["--max-batch-tokens", "4096"], environ={})
    assert engine_config(told, "cpu").max_batch_tokens == 4096
    assert all(engine_config(s, "cpu").per_request_processors for s in (default, told))


def test_a_hub_repositorys_gguf_file_joins_the_model_spec():
    settings = parse_settings(["--model", "org/repo", "--gguf-file", "m-Q4_K_M.gguf"], environ={})
    assert settings.model_spec == "org/repo:m-Q4_K_M.gguf"
    assert parse_settings(["--model", "org/repo"], environ={}).model_spec == "org/repo"


def test_main_exits_2_for_a_cpu_isa_of_another_architecture(capsys, monkeypatch):
    import platform

    other = "neon" if platform.machine() in ("x86_64", "AMD64") else "avx2"
    monkeypatch.setenv("KVSERVE_CPU_ISA", "native")      # main sets it; restored after
    assert main(["--cpu-isa", other]) == 2
    err = capsys.readouterr().err
    assert other in err and "generic" in err

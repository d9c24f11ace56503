"""Every deployment file in configs/ loads and validates, documents each key it
sets, and describes the deployment it is named for."""

import re
from pathlib import Path

import pytest
import yaml

from server.cli import parse_settings
from server.settings import ServerSettings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_deployments_are_all_there():
    assert {p.name for p in CONFIG_FILES} >= {"default.yaml", "gpu.yaml", "tp.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_loads(path):
    settings = parse_settings(["--config", str(path)], environ={})
    settings.continuous_batching_config()  # the engine's own validation passes too
    assert set(yaml.safe_load(path.read_text())) <= set(ServerSettings.model_fields)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_key_has_a_comment_above_it(path):
    """Each key sits under a comment (keys documented together, like host and port,
    share one)."""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^[a-z_]+:", line):
            above = number - 1
            while above >= 0 and re.match(r"^[a-z_]+:", lines[above]):
                above -= 1
            documented = above >= 0 and lines[above].startswith("#")
            assert documented, f"{path.name}:{number + 1} {line!r} is undocumented"


def test_gpu_config_targets_a_gpu():
    settings = parse_settings(["--config", str(CONFIGS / "gpu.yaml")], environ={})
    assert settings.device.startswith("cuda") and settings.dtype == "bfloat16"
    assert settings.max_queue_size and settings.request_timeout_s


def test_default_config_is_a_safe_cpu_default():
    settings = parse_settings(["--config", str(CONFIGS / "default.yaml")], environ={})
    assert settings.host == "127.0.0.1" and settings.cors_allow_origins == []
    assert not settings.enable_fault_injection and not settings.log_prompts


def test_tp_config_splits_a_model_over_gpus():
    settings = parse_settings(["--config", str(CONFIGS / "tp.yaml")], environ={})
    assert settings.tp_size > 1 and settings.device == "cuda"
    assert "torchrun" in (CONFIGS / "tp.yaml").read_text()

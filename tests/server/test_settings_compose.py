"""docker/compose.yaml configures the server by environment alone.

No Docker engine here: each service's `environment` is interpolated the way compose
does (`${VAR:-default}` from a given shell), and the container's command line (the
Dockerfile's CMD, its config file included) is parsed with that environment, as
`python -m server` in the container would."""

import re
from pathlib import Path

import pytest
import yaml

from server.cli import parse_settings
from server.settings import ServerSettings
from server.settings_env import env_table, unknown_variables

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
DOCKERFILES = {"kvserve": "Dockerfile", "kvserve-gpu": "Dockerfile.cuda"}


def interpolate(text: str, shell: dict[str, str]) -> str:
    """Compose's `${NAME}` and `${NAME:-default}` (the default also for an empty one)."""
    def value(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        return shell.get(name) or (default or "")
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", value, text)


def container_settings(service: str, shell: dict[str, str]) -> ServerSettings:
    """The settings `service` would start with, given the shell's variables."""
    environ = {name: interpolate(str(text), shell)
               for name, text in COMPOSE["services"][service]["environment"].items()}
    dockerfile = (ROOT / "docker" / DOCKERFILES[service]).read_text()
    cmd = yaml.safe_load(re.search(r"^CMD (\[.+\])$", dockerfile, re.MULTILINE).group(1))
    argv = cmd[cmd.index("server") + 1:]
    argv[argv.index("--config") + 1] = str(ROOT / argv[argv.index("--config") + 1])
    return parse_settings(argv, environ=environ)


@pytest.mark.parametrize("service", DOCKERFILES)
def test_compose_names_only_real_settings(service):
    environ = COMPOSE["services"][service]["environment"]
    assert unknown_variables(environ, ServerSettings.model_fields) == []
    kvserve = {name for name in environ if name.startswith("KVSERVE_")}
    assert kvserve <= set(env_table(ServerSettings.model_fields))
    assert {"KVSERVE_MODEL", "KVSERVE_DTYPE", "KVSERVE_API_KEY"} <= kvserve
    assert environ["HF_TOKEN"] == "${HF_TOKEN:-}"


def test_cpu_service_defaults():
    settings = container_settings("kvserve", shell={})
    assert settings.model == "smollm2-135m-instruct" and settings.dtype == "auto"
    assert (settings.max_batch_tokens, settings.max_queue_size) == (2048, 64)
    assert settings.request_timeout_s == 600.0 and settings.api_key is None
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)     # the CMD's flags


def test_cpu_service_serves_a_mounted_gguf_chosen_by_environment():
    shell = {"KVSERVE_MODEL": "/models/my-model-Q4_K_M.gguf", "KVSERVE_DTYPE": "bf16-weights",
             "KVSERVE_MAX_BATCH_TOKENS": "512", "KVSERVE_MAX_QUEUE_SIZE": "8",
             "KVSERVE_REQUEST_TIMEOUT_S": "30", "KVSERVE_API_KEY": "k1,k2",
             "HF_TOKEN": "hf_x", "KVSERVE_PORT": "9999"}
    settings = container_settings("kvserve", shell)
    assert settings.model == "/models/my-model-Q4_K_M.gguf"
    assert settings.dtype == "bf16-weights"
    assert (settings.max_batch_tokens, settings.max_queue_size) == (512, 8)
    assert settings.request_timeout_s == 30.0 and settings.api_key == ["k1", "k2"]
    assert settings.port == 8000            # KVSERVE_PORT is the host side of the mapping
    service = COMPOSE["services"]["kvserve"]
    mount = next(interpolate(v, {}) for v in service["volumes"] if ":/models" in v)
    assert mount == "../models:/models:ro"     # models/ beside docker/, read-only
    assert settings.model.startswith(mount.split(":")[1] + "/")
    assert "127.0.0.1:${KVSERVE_PORT:-8000}:8000" in service["ports"]


def test_gpu_service_keeps_its_config_unless_the_shell_says_otherwise():
    gpu_file = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    settings = container_settings("kvserve-gpu", shell={})
    for name in ("model", "dtype", "max_batch_tokens", "max_queue_size", "request_timeout_s"):
        assert getattr(settings, name) == gpu_file[name], name
    shell = {"KVSERVE_MODEL": "org/repo", "KVSERVE_GGUF_FILE": "m-Q8_0.gguf",
             "KVSERVE_DTYPE": "float16"}
    settings = container_settings("kvserve-gpu", shell)
    assert settings.model_spec == "org/repo:m-Q8_0.gguf" and settings.dtype == "float16"
    assert settings.max_queue_size == gpu_file["max_queue_size"]


def test_health_check_and_mounts_are_shared():
    for service in DOCKERFILES:
        config = COMPOSE["services"][service]
        assert "/health" in " ".join(config["healthcheck"]["test"])
        assert any(v.endswith(":/models:ro") for v in config["volumes"])

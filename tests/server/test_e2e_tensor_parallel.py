"""The tensor-parallel deployment file, run for real on CPU: `torchrun --nproc-per-node 3
-m server --config configs/tp.yaml` with the default model (3 KV heads, so 3 ranks
over gloo). Rank 0 answers like the single-process server; SIGTERM to torchrun lets
a running stream finish and every rank exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.server.conftest import (ENGINE_FLAGS, MODEL, REPO_ROOT, RunningServer,
                                   _wait_until_healthy, free_port)

TP_SIZE = 3
OVERRIDES = ["--model", MODEL, "--tp-size", str(TP_SIZE), "--device", "cpu",
             "--dtype", "float32", "--log-level", "info", *ENGINE_FLAGS]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("tp-server") / "server.log"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(TP_SIZE), "-m", "server",
               "--config", "configs/tp.yaml", *OVERRIDES, "--host", "127.0.0.1",
               "--port", str(port)]
    environ = {k: v for k, v in os.environ.items()
               if k not in ("KVSERVE_API_KEY", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**environ, "PYTHONUNBUFFERED": "1"})
    running = RunningServer(f"http://127.0.0.1:{port}", "", process, log_path)
    try:
        _wait_until_healthy(running)
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for child in psutil.Process().children(recursive=True):
            if "server" in " ".join(child.cmdline()) and str(port) in " ".join(child.cmdline()):
                child.kill()


def complete(base_url: str, prompt: str, headers: dict | None = None) -> str:
    response = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_ranks_answer_like_the_single_process_server(tp_server, server):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, complete(tp_server.base_url, p)))
               for p in prompts]              # concurrently: one batch on the ranks
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt in prompts:
        assert results[prompt] == complete(server.base_url, prompt, server.headers())
    log = tp_server.log_tail()
    assert "rank 1 of 3: following" in log and "rank 2 of 3: following" in log


def test_sigterm_lets_a_stream_finish_and_every_rank_exit(tp_server):
    ranks = [p for p in psutil.Process(tp_server.process.pid).children()]
    assert len(ranks) == TP_SIZE
    chunks: list[dict] = []
    done = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{tp_server.base_url}/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Count to twenty."}],
                "max_tokens": 24, "temperature": 0, "stream": True}) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done.set()
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(chunks) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    tp_server.process.send_signal(signal.SIGTERM)   # torchrun forwards it to every rank
    reader.join(timeout=120)
    assert done.is_set(), tp_server.log_tail()
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finish == ["length"]
    _, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive, tp_server.log_tail()
    assert "this rank stops when the driver rank has drained" in tp_server.log_tail()

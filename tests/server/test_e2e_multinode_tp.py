"""Tensor parallelism across node ranks, on one host: three `torchrun --nnodes 3
--nproc-per-node 1` agents (one per node rank; the default model has 3 KV heads, so
3 ranks) meet at a c10d rendezvous on 127.0.0.1 and run one server over gloo. Every
rank has LOCAL_RANK 0; the rank the rendezvous makes 0 serves HTTP and answers like
the single-process server, and SIGTERM to every agent stops every rank
(docs/deployment.md, "Tensor parallelism across hosts")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server.conftest import (ENGINE_FLAGS, MODEL, REPO_ROOT, STARTUP_TIMEOUT_S,
                                   RunningServer, free_port)
from tests.server.test_e2e_tensor_parallel import complete

NODES = 3


@pytest.fixture(scope="module")
def multinode_server(tmp_path_factory):
    port, rdzv_port = free_port(), free_port()
    log_dir = tmp_path_factory.mktemp("multinode")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    environ = {k: v for k, v in os.environ.items()
               if k not in ("KVSERVE_API_KEY", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = []
    for node_rank in range(NODES):
        # Every node gets the same server flags: only global rank 0 binds the port.
        command = [torchrun, "--nnodes", str(NODES), "--nproc-per-node", "1",
                   "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", f"kvserve-{port}",
                   "-m", "server", "--model", MODEL, "--tp-size", str(NODES),
                   "--device", "cpu", "--dtype", "float32", "--log-level", "info",
                   *ENGINE_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
        with open(log_dir / f"node{node_rank}.log", "wb") as log:
            agents.append(subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                           stderr=subprocess.STDOUT,
                                           env={**environ, "PYTHONUNBUFFERED": "1"}))
    running = RunningServer(f"http://127.0.0.1:{port}", "", agents[0], log_dir / "node0.log")
    try:
        _wait_until_healthy_any(running, agents)
        yield running, log_dir, agents
    finally:
        _stop(agents)


def _wait_until_healthy_any(running: RunningServer, agents: list) -> None:
    """Healthy wherever rank 0 landed; any node rank's agent exiting fails the start."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        exited = [n for n, agent in enumerate(agents) if agent.poll() is not None]
        assert not exited, f"node ranks {exited} exited:\n{running.log_tail()}"
        try:
            if httpx.get(f"{running.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no rank serving after {STARTUP_TIMEOUT_S}s:\n{running.log_tail()}")


def _stop(agents: list) -> None:
    ranks = []
    for agent in agents:
        try:
            ranks += psutil.Process(agent.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for process in agents:
        if process.poll() is None:
            process.kill()
            process.wait()
    for rank in ranks:
        try:
            rank.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(ranks, timeout=30)


def test_node_ranks_answer_like_the_single_process_server(multinode_server, server):
    running, log_dir, _ = multinode_server
    for prompt in ["The capital of France is", "def fibonacci(n):"]:
        assert complete(running.base_url, prompt) == complete(server.base_url, prompt,
                                                              server.headers())
    logs = "".join((log_dir / f"node{r}.log").read_text(errors="replace") for r in range(NODES))
    assert "rank 1 of 3: following" in logs and "rank 2 of 3: following" in logs


def test_sigterm_to_every_node_stops_every_rank(multinode_server):
    """What an orchestrator does to all hosts: the driver drains, the followers follow
    its stop message, and every torchrun agent exits."""
    _, _, agents = multinode_server
    ranks = [child for agent in agents for child in psutil.Process(agent.pid).children()]
    assert len(ranks) == NODES
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive
    for agent in agents:
        agent.wait(timeout=30)

"""kvserve replicas behind vllm-router, as separate processes on 127.0.0.1.

A `Replica` is one `python -m server` that the tests can SIGKILL, SIGTERM and start
again on the same port (a restarted container keeps its address). A `Router` is the
`vllm-router` binary in front of some replicas. Both are stopped by their own PID only,
and `stop_all` runs in the fixtures' `finally`, so a failing test leaves nothing behind.

`run_workload` sends completions whose prompts share a few long prefixes and returns
the replicas' summed prefix-cache hit ratio over the run (deltas of
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.server.conftest import MODEL, REPO_ROOT, free_port, scrape

START_TIMEOUT_S = 240
ROUTER_BIN = os.path.join(os.path.dirname(sys.executable), "vllm-router")
# Health every second, one failure marks a replica out: the router notices a dead or
# draining replica within ~2 s. /ready (not /health) answers 503 while draining. No
# circuit breaker: once a dead replica's refused connections open it, the replica
# restarted may get no request for a minute or more, while health checks alone take
# it out and back within seconds.
ROUTER_HEALTH_FLAGS = ["--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
                       "--health-failure-threshold", "1", "--health-success-threshold", "1",
                       "--health-check-timeout-secs", "2", "--disable-circuit-breaker"]


def _wait_for(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited at start:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not up after {timeout_s}s:\n{log_path.read_text()[-3000:]}")


class Replica:
    def __init__(self, log_dir: Path, name: str, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "server", "--model", MODEL, "--host", "127.0.0.1",
                   "--port", str(self.port), *self.flags]
        environ = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            env={**environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> None:
        _wait_for(f"{self.url}/ready", self.process, self.log_path, START_TIMEOUT_S)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def counters(self) -> tuple[float, float]:
        """(prefix-cache hits, queries), in tokens, since this process started."""
        samples = scrape(self.url)
        return (samples["vllm:prefix_cache_hits_total{}"],
                samples["vllm:prefix_cache_queries_total{}"])

    def finished_requests(self) -> float:
        return sum(v for k, v in scrape(self.url).items()
                   if k.startswith("vllm:request_success_total"))


class Router:
    def __init__(self, log_dir: Path, replicas: list[Replica], policy: str,
                 extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"router-{policy}-{self.port}.log"
        command = [ROUTER_BIN, "--host", "127.0.0.1", "--port", str(self.port),
                   "--worker-urls", *[r.url for r in replicas], "--policy", policy,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--log-level", "warning", *ROUTER_HEALTH_FLAGS, *extra]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait_for(f"{self.url}/health", self.process, self.log_path, 60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stop_all(processes: list) -> None:
    for process in processes:
        try:
            process.stop()
        except Exception:   # keep stopping the others
            pass


def shared_prefix_prompts(seed: int, num_prefixes: int, per_prefix: int,
                          prefix_words: int) -> list[str]:
    """`num_prefixes` long random prefixes, each followed by `per_prefix` distinct
    questions, in a seeded random order (so round robin cannot pin a prefix to one
    replica by accident of alternation)."""
    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "paper", "engine", "garden", "copper", "window",
             "signal", "harbor", "lantern", "meadow", "circuit", "velvet", "orbit", "timber"]
    prefixes = [" ".join(rng.choice(words) for _ in range(prefix_words))
                for _ in range(num_prefixes)]
    prompts = [f"{prefix}\nQuestion {rng.randrange(10**6)}: what comes next?"
               for prefix in prefixes for _ in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


def complete(base_url: str, prompt: str, max_tokens: int = 2, timeout_s: float = 60) -> int:
    response = httpx.post(f"{base_url}/v1/completions", timeout=timeout_s, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return response.status_code


def run_workload(base_url: str, replicas: list[Replica], prompts: list[str],
                 concurrency: int = 3) -> float:
    """Send every prompt through `base_url`; all must succeed. Returns the summed
    hit ratio of `replicas` over this run."""
    before = [r.counters() for r in replicas]
    with ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(lambda p: complete(base_url, p), prompts))
    assert statuses == [200] * len(prompts), statuses
    after = [r.counters() for r in replicas]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return hits / queries

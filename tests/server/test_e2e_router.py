"""Two kvserve replicas behind vllm-router (docs/deployment.md, "Behind a router").

Each replica's KV cache holds about half of the workload's long prefixes; one server
with both caches' blocks holds them all. With `--policy cache_aware` the router keeps
each prefix on one replica, so the replicas' summed prefix-cache hit ratio stays
close to the single server's; with `round_robin` every replica sees every prefix and
evicts them in turn, so it hits less. API keys pass through the router to the replicas.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from tests.server.conftest import MODEL, REPO_ROOT
from tests.server.router_setup import (ROUTER_HEALTH_FLAGS, Replica, Router, run_workload,
                                       shared_prefix_prompts, stop_all)

BLOCK = 16
REPLICA_BLOCKS = 80          # ~4 prefixes of 20 blocks with room for the running requests
FLAGS = ["--page-size", str(BLOCK), "--log-level", "warning", "--max-queue-size", "32",
         "--request-timeout", "60"]
WORKLOAD = dict(num_prefixes=6, per_prefix=6, prefix_words=240)   # ~20 blocks per prefix


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    single = Replica(log_dir, "single", [*FLAGS, "--num-blocks", str(2 * REPLICA_BLOCKS)])
    replicas = [Replica(log_dir, f"replica{i}", [*FLAGS, "--num-blocks", str(REPLICA_BLOCKS)])
                for i in range(2)]
    everything = [single, *replicas]
    try:
        for server in everything:
            server.start()
        for server in everything:
            server.wait_ready()
        yield log_dir, single, replicas
    finally:
        stop_all(everything)


def test_cache_aware_keeps_prefixes_where_they_are_cached(servers):
    log_dir, single, replicas = servers
    prompts = shared_prefix_prompts(seed=1, **WORKLOAD)
    single_ratio = run_workload(single.url, [single], prompts)

    router = Router(log_dir, replicas, "cache_aware")
    try:
        cache_aware = run_workload(router.url, replicas, prompts)
    finally:
        router.stop()
    router = Router(log_dir, replicas, "round_robin")
    try:
        round_robin = run_workload(router.url, replicas, shared_prefix_prompts(seed=2, **WORKLOAD))
    finally:
        router.stop()

    print(f"\nprefix-cache hit ratio: single {single_ratio:.3f}, "
          f"cache_aware {cache_aware:.3f}, round_robin {round_robin:.3f}")
    assert single_ratio > 0.5           # the workload does share prefixes
    assert cache_aware >= 0.8 * single_ratio
    assert cache_aware > round_robin + 0.1


def test_api_keys_pass_through_the_router(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router-keys")
    replica = Replica(log_dir, "keyed", [*FLAGS, "--num-blocks", "64", "--api-key", "k1"])
    router = None
    try:
        replica.start()
        replica.wait_ready()
        router = Router(log_dir, [replica], "cache_aware")
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        url = f"{router.url}/v1/completions"
        for headers, status in [({"Authorization": "Bearer k1"}, 200), ({"x-api-key": "k1"}, 200),
                                ({"Authorization": "Bearer wrong"}, 401), ({}, 401)]:
            response = httpx.post(url, headers=headers, json=body, timeout=60)
            assert response.status_code == status, (headers, response.text)
        models = httpx.get(f"{router.url}/v1/models", headers={"Authorization": "Bearer k1"},
                           timeout=10).json()
        assert models["data"][0]["max_model_len"] > 0
    finally:
        stop_all([p for p in (router, replica) if p is not None])


def test_compose_replicas_profile_runs_the_router_as_tested():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [name for name, s in services.items()
                if s.get("profiles") == ["replicas"] and name != "router"]
    router = services["router"]
    assert router["profiles"] == ["replicas"] and len(replicas) >= 2
    command = router["command"]
    urls = command[command.index("--worker-urls") + 1:command.index("--policy")]
    assert urls == [f"http://{name}:8000" for name in replicas]
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert " ".join(ROUTER_HEALTH_FLAGS) in " ".join(command)
    assert set(router["depends_on"]) == set(replicas)
    for name in replicas:
        service = services[name]
        assert "ports" not in service            # reached through the router only
        assert service["restart"] == "unless-stopped"
        assert "/health" in " ".join(service["healthcheck"]["test"])
        assert service["environment"] == services["kvserve"]["environment"]

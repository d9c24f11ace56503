"""The Kubernetes manifests in docker/k8s/ cannot run here (no cluster); this checks
that what they name exists: every metric is one a running kvserve exports, every probe
and scrape path answers without an API key, every port agrees with the port the image
serves on, every selector finds the pods, and every KVSERVE_* variable is a setting."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server.conftest import REPO_ROOT

K8S = REPO_ROOT / "docker" / "k8s"
METRIC = re.compile(r"\b(?:vllm|kvserve):[a-z_]+")


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict:
    matches = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def strings(node) -> list[str]:
    """Every string in a parsed document, embedded YAML files (ConfigMap data) included,
    but image names (`kvserve:cpu` is a tag, not a metric)."""
    if isinstance(node, dict):
        return [s for key, value in node.items() if key != "image" for s in strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in strings(item)]
    return [node] if isinstance(node, str) else []


def image_port() -> int:
    """The port the CPU image's command serves on (docker/Dockerfile's CMD)."""
    cmd = next(line for line in (REPO_ROOT / "docker" / "Dockerfile").read_text().splitlines()
               if line.startswith("CMD "))
    argv = json.loads(cmd[4:])
    return int(argv[argv.index("--port") + 1])


def kvserve_container() -> dict:
    (container,) = find("Deployment", "kvserve")["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_parses_and_embedded_configs_too():
    kinds = sorted(d["kind"] for d in documents())
    assert kinds == ["ConfigMap", "Deployment", "Deployment", "InferencePool", "Service",
                     "Service"]
    config = yaml.safe_load(find("ConfigMap", "kvserve-epp")["data"]["epp-config.yaml"])
    plugins = {p["type"] for p in config["plugins"]}
    refs = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert refs <= plugins


def test_every_metric_named_is_exported(server):
    exported = set()
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            exported.add(line.split()[2])
        elif line and not line.startswith("#"):
            exported.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    named = {m for s in strings(documents()) for m in METRIC.findall(s)}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= named
    assert named <= exported, named - exported


def test_probe_and_scrape_paths_answer_without_a_key(server):
    container = kvserve_container()
    template = find("Deployment", "kvserve")["spec"]["template"]
    paths = {container[p]["httpGet"]["path"]
             for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    paths.add(template["metadata"]["annotations"]["prometheus.io/path"])
    assert paths == {"/health", "/ready", "/metrics"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"   # 503 while draining
    for path in paths:
        assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 200, path


def test_ports_and_selectors_agree_with_the_image_and_each_other():
    port = image_port()
    container = kvserve_container()
    (http,) = container["ports"]
    assert http["containerPort"] == port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in (http["name"], port)
    template = find("Deployment", "kvserve")["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    labels = template["metadata"]["labels"]

    service = find("Service", "kvserve")
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [http["name"]]

    pool = find("InferencePool", "kvserve")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [port]
    epp_service = find("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in
                                                           epp_service["spec"]["ports"]]
    epp = find("Deployment", "kvserve-epp")["spec"]["template"]
    assert epp_service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    (epp_container,) = epp["spec"]["containers"]
    assert f"--pool-name={find('InferencePool', 'kvserve')['metadata']['name']}" in \
        epp_container["args"]


@pytest.mark.slow
def test_every_environment_variable_is_a_setting():
    help_text = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    words = " ".join(help_text.split())      # argparse wraps "[env NAME]" anywhere
    names = {e["name"] for e in kvserve_container()["env"]}
    assert names and not [n for n in names if f"env {n}" not in words], names

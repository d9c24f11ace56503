"""End to end on a server configured like a deployment: keys from KVSERVE_API_KEY,
/metrics behind the key, the default body limit, a request timeout, and request
logs at INFO. Checks the 413, the timeout (error body, blocks freed) and the log
lines (fields present, prompt text absent)."""

import json
import time

import httpx
import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ENV_KEYS = "env-key-1,env-key-2"
TIMEOUT_S = 3
FLAGS = ["--page-size", "16", "--num-blocks", "64", "--request-timeout", str(TIMEOUT_S),
         "--open-paths", "/health", "/ready", "--log-level", "info"]
SECRET = "zebra-umbrella-7741"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    yield from launch_server(tmp_path_factory, FLAGS, env={"KVSERVE_API_KEY": ENV_KEYS},
                             api_key="env-key-2")


def post(server, path, body, **kwargs):
    return httpx.post(server.base_url + path, json=body, headers=server.headers(),
                      timeout=60, **kwargs)


def wait_idle(server, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        idle = health["num_running"] == 0 and health["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return health


def test_env_keys_and_metrics_behind_the_key(deployed):
    url = deployed.base_url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    for key in ENV_KEYS.split(","):
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
    # /metrics is not in this server's open paths; the probes are.
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers=deployed.headers()).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").json() == {"status": "ready"}


def test_5mb_body_is_413_under_the_default_limit(deployed):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    response = post(deployed, "/v1/chat/completions", body)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "4194304" in error["message"]
    assert post(deployed, "/v1/completions",
                {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_timed_out_request_is_cancelled_and_frees_its_blocks(deployed):
    total = deployed.health()["num_blocks"]
    started = time.monotonic()
    response = post(deployed, "/v1/chat/completions", LONG)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5
    health = wait_idle(deployed)
    assert (health["num_running"], health["num_waiting"]) == (0, 0)
    assert health["num_free_blocks"] == total


def test_timed_out_stream_ends_with_an_error_event(deployed):
    total = deployed.health()["num_blocks"]
    events = []
    with httpx.stream("POST", deployed.base_url + "/v1/chat/completions",
                      json={**LONG, "stream": True}, headers=deployed.headers(),
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:  # mid-stream: the request holds cache blocks
                    health = deployed.health()
                    assert health["num_running"] == 1 and health["num_free_blocks"] < total
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    health = wait_idle(deployed)
    assert (health["num_running"], health["num_free_blocks"]) == (0, total)


def parse_logfmt(line: str) -> dict:
    """'a=1 b="x y"' -> {"a": "1", "b": "x y"} (values as text)."""
    fields, rest = {}, line
    while rest:
        key, _, rest = rest.partition("=")
        if rest.startswith('"'):
            value, end = json.JSONDecoder().raw_decode(rest)
            rest = rest[end:]
        else:
            value, _, rest = rest.partition(" ")
        fields[key.strip()] = str(value)
        rest = rest.lstrip()
    return fields


def request_lines(server) -> list[dict]:
    text = server.log_path.read_text(errors="replace")
    return [parse_logfmt(line.split("request ", 1)[1]) for line in text.splitlines()
            if line.startswith("INFO:  request ")]


def test_one_log_line_per_request_without_prompt_text(deployed):
    body = {"model": MODEL, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Remember {SECRET}."}]}
    answer = post(deployed, "/v1/chat/completions", body).json()
    refused = httpx.get(deployed.base_url + "/v1/models")
    assert refused.status_code == 401
    time.sleep(0.2)  # the line is written once the response is complete
    lines = request_lines(deployed)
    mine = [line for line in lines if line.get("id") == answer["id"]]
    assert len(mine) == 1
    line = mine[0]
    assert line["status"] == "200" and line["path"] == "/v1/chat/completions"
    assert int(line["prompt_tokens"]) == answer["usage"]["prompt_tokens"]
    assert int(line["completion_tokens"]) == 2 and line["finish_reason"] == "length"
    assert 0 < float(line["ttft_ms"]) <= float(line["latency_ms"])
    assert any(l["status"] == "401" and l["path"] == "/v1/models" for l in lines)
    timed_out = [l for l in lines if l.get("status") == "504"]
    streamed = [l for l in lines if l.get("error") == "request_timeout" and l["stream"] == "true"]
    assert timed_out and streamed and timed_out[0]["finish_reason"] == "abort"
    assert SECRET not in deployed.log_path.read_text(errors="replace")

"""End to end: GET /metrics speaks Prometheus with vLLM's metric names, and its
counters move by exactly what known requests did."""

import json
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # the model the `server` fixture serves
PAGE_SIZE = 16                   # the `server` fixture's --page-size

# family name (as the parser reports it: counters without `_total`) -> type
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_parse_with_vllm_names_and_need_no_key(server):
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)  # no Authorization
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in VLLM_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    assert "vllm:prompt_tokens_total" in response.text
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": MODEL}
    assert families["kvserve:engine_alive"].samples[0].value == 1
    blocks = families["kvserve:kv_cache_blocks"].samples[0].value
    assert blocks == server.health()["num_blocks"]


def completion(server, prompt: str, max_tokens: int) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers(),
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chat(server, max_tokens: int) -> dict:
    """Stream a chat answer over raw SSE; return its usage."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      headers=server.headers(), timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_counters_move_by_what_the_requests_did(server):
    before = server.metrics()
    first = completion(server, f"Run {uuid.uuid4().hex}: tell me about ships.", 5)["usage"]
    chat = streamed_chat(server, 3)
    after = server.metrics()
    prompt = first["prompt_tokens"] + chat["prompt_tokens"]
    assert (first["completion_tokens"], chat["completion_tokens"]) == (5, 3)
    assert delta(before, after, "vllm:prompt_tokens_total{}") == prompt
    assert delta(before, after, "vllm:generation_tokens_total{}") == 8
    assert delta(before, after, "vllm:request_success_total{finished_reason=length}") == 2
    assert delta(before, after, "vllm:time_to_first_token_seconds_count{}") == 2
    assert delta(before, after, "vllm:request_queue_time_seconds_count{}") == 2
    queued = delta(before, after, "vllm:request_queue_time_seconds_sum{}")
    assert 0 <= queued <= delta(before, after, "vllm:time_to_first_token_seconds_sum{}")
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count{}") == 2
    # One gap between consecutive tokens: (5 - 1) + (3 - 1).
    assert delta(before, after, "vllm:inter_token_latency_seconds_count{}") == 6
    assert delta(before, after, "vllm:request_prompt_tokens_sum{}") == prompt
    assert delta(before, after, "vllm:request_generation_tokens_sum{}") == 8
    assert 0 < delta(before, after, "vllm:time_to_first_token_seconds_sum{}") < 60
    assert delta(before, after, "kvserve:prefill_tokens_total{}") > 0


def prompt_ending_in_a_partial_page(server) -> tuple[str, int]:
    """A prompt with a random start (no earlier request's page shares its first
    tokens) whose tokens but the last do not fill whole pages, so a page is copied in
    part. The random hex splits into a varying number of tokens: without the check
    about one draw in sixteen had no part of a page to copy."""
    while True:
        prompt = f"{uuid.uuid4().hex} run: " + "the quick brown fox jumps over the lazy dog " * 4
        response = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(),
                              json={"model": MODEL, "prompt": prompt}, timeout=30)
        assert response.status_code == 200, response.text
        count = response.json()["count"]
        if (count - 1) % PAGE_SIZE:
            return prompt, count


def test_prefix_cache_counters_count_tokens(server):
    prompt, counted = prompt_ending_in_a_partial_page(server)
    before = server.metrics()
    tokens = completion(server, prompt, 1)["usage"]["prompt_tokens"]
    assert tokens == counted
    middle = server.metrics()
    completion(server, prompt, 1)
    after = server.metrics()
    # A fresh prompt is looked up but found nowhere.
    assert delta(before, middle, "vllm:prefix_cache_queries_total{}") == tokens
    assert delta(before, middle, "vllm:prefix_cache_hits_total{}") == 0
    # The same prompt again hits every token but its last, which is always recomputed:
    # the full pages from the prefix cache, the rest copied from the first request's
    # page (its block is still free and untouched).
    assert delta(middle, after, "vllm:prefix_cache_queries_total{}") == tokens
    assert delta(middle, after, "vllm:prefix_cache_hits_total{}") == tokens - 1
    assert (tokens - 1) % PAGE_SIZE            # (so the test covers a partial page)


def test_gauges_follow_a_running_request_and_abort_is_counted(server):
    before = server.metrics()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body,
                      headers=server.headers(), timeout=60) as response:
        assert response.status_code == 200
        # Keep a reference: a collected line iterator would close the connection.
        lines = response.iter_lines()
        chunks = 0
        for line in lines:
            chunks += line.startswith("data: {")
            if chunks >= 3:
                break
        during = server.metrics()
    assert chunks == 3
    assert during["vllm:num_requests_running{}"] == 1
    assert during["vllm:num_requests_waiting{}"] == 0
    assert 0 < during["vllm:kv_cache_usage_perc{}"] <= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = server.metrics()
        if delta(before, after, "vllm:request_success_total{finished_reason=abort}") >= 1:
            break
        time.sleep(0.1)
    assert delta(before, after, "vllm:request_success_total{finished_reason=abort}") == 1
    while after["vllm:num_requests_running{}"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the engine drops the request at its next step
        after = server.metrics()
    assert after["vllm:num_requests_running{}"] == 0
    assert after["vllm:kv_cache_usage_perc{}"] == 0


def test_fault_injection_route_is_off_by_default(server):
    response = httpx.post(f"{server.base_url}/debug/fail-engine", headers=server.headers())
    assert response.status_code == 404
    assert server.health()["status"] == "ok"


def test_what_routers_read(server):
    """vllm:cache_config_info (an endpoint picker's block size and cache size), the
    queue gauges, and max_model_len on /v1/models."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    [sample] = info.samples
    assert sample.value == 1
    num_blocks = server.health()["num_blocks"]
    assert sample.labels == {"block_size": str(PAGE_SIZE), "num_gpu_blocks": str(num_blocks),
                             "cache_dtype": "auto", "enable_prefix_caching": "True",
                             "cpu_offload_gb": "0.0", "engine": "0"}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert 0 <= families[name].samples[0].value <= (1 if name.endswith("perc") else 64)
    models = httpx.get(f"{server.base_url}/v1/models", headers=server.headers(), timeout=10)
    [card] = models.json()["data"]
    assert card["max_model_len"] == min(8192, num_blocks * PAGE_SIZE)   # context 8192

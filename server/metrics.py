"""GET /metrics: Prometheus metrics under the names vLLM uses.

Dashboards and alerts written for vLLM work unchanged: every `vllm:*` series below
has vLLM's name, unit and meaning, and a `model_name` label. Two sources feed them:

    engine state, read at scrape time (EngineCollector):
        vllm:num_requests_running        gauge    requests in the running batch
        vllm:num_requests_waiting        gauge    requests queued for admission
        vllm:kv_cache_usage_perc         gauge    share of KV blocks held, 0..1
        vllm:num_preemptions_total       counter  requests preempted for cache space
        vllm:prefix_cache_queries_total  counter  prompt tokens looked up in the prefix cache
        vllm:prefix_cache_hits_total     counter  of those, tokens found cached
        vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total,
        ..._num_accepted_tokens_total,
        ..._num_accepted_tokens_per_pos_total{position}  speculative decoding's proposals
                                         and acceptances
        kvserve:* (ours)                 engine alive, block counts, steps, swaps

    the cache's layout, fixed at start (what routers' endpoint pickers read):
        vllm:cache_config_info{block_size, num_gpu_blocks, cache_dtype,
                               enable_prefix_caching, cpu_offload_gb, engine}  gauge, 1

    each finished engine request (one per choice), observed by the server:
        vllm:prompt_tokens_total / vllm:generation_tokens_total       counters
        vllm:request_success_total{finished_reason}   stop | length | abort | error
        vllm:time_to_first_token_seconds              arrival -> first token
        vllm:inter_token_latency_seconds              gap between consecutive tokens
        vllm:e2e_request_latency_seconds              arrival -> finished
        vllm:request_prompt_tokens / vllm:request_generation_tokens   per request

Times come from the engine's own clock: `created_time` when the request was added
and a `perf_counter` timestamp per generated token (`record_timestamps=True`).
Each server owns its registry, so several apps in one process never collide.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.outputs import GenerationOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges in seconds / tokens, spanning a fast GPU to a loaded CPU host.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# Engine stats counted since start -> (our counter name, help text).
_ENGINE_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Requests preempted to free KV cache space."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_steps": ("kvserve:engine_steps", "Forward passes run by the engine."),
    "num_prefill_tokens": ("kvserve:prefill_tokens", "Prompt tokens computed (not cached)."),
    "num_evictions": ("kvserve:kv_cache_evictions", "Cached blocks evicted for reuse."),
    "num_swapped_out": ("kvserve:kv_swapped_out", "Preempted requests swapped to CPU memory."),
    "num_swapped_in": ("kvserve:kv_swapped_in", "Requests swapped back from CPU memory."),
    "spec_num_drafts": ("vllm:spec_decode_num_drafts",
                        "Speculative proposals verified (one per request and step)."),
    "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",
                                 "Draft tokens accepted."),
}
_PER_POSITION = "spec_accepted_at_"
"""Engine stats `spec_accepted_at_<i>`: drafts accepted at position i of their step."""
_ENGINE_GAUGES = {
    "num_blocks": ("kvserve:kv_cache_blocks", "KV cache blocks in total."),
    "num_free_blocks": ("kvserve:kv_cache_free_blocks",
                        "KV cache blocks not held by a request (cached ones included)."),
    "num_cached_blocks": ("kvserve:kv_cache_cached_blocks",
                          "KV cache blocks indexed by the prefix cache."),
}


class EngineCollector:
    """Reads `engine.stats()` at every scrape: no thread, nothing to keep in sync."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        alive = self._engine.is_running()
        yield self._gauge("kvserve:engine_alive", "1 while the engine thread runs.", int(alive))
        stats = self._engine.stats()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats["num_running"])
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting for admission.",
                          stats["num_waiting"])
        blocks = stats["num_blocks"]          # 0: an encoder, which has no KV cache
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "KV cache usage: share of blocks held by requests (1 = full).",
                          1.0 - stats["num_free_blocks"] / blocks if blocks else 0.0)
        for key, (name, documentation) in _ENGINE_GAUGES.items():
            yield self._gauge(name, documentation, stats[key])
        for key, (name, documentation) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(self._labels, stats[key])
            yield family
        positions = sorted(int(key.removeprefix(_PER_POSITION)) for key in stats
                           if key.startswith(_PER_POSITION))
        if positions:
            family = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by their position among a step's drafts (0 first).",
                labels=["model_name", "position"])
            for position in positions:
                family.add_metric([*self._labels, str(position)],
                                  stats[f"{_PER_POSITION}{position}"])
            yield family


def cache_config_labels(block_size: int, num_blocks: int, cache_dtype: str,
                        prefix_caching: bool, cpu_offload_gb: float) -> dict[str, str]:
    """vllm:cache_config_info's labels, named and written as vLLM writes its
    CacheConfig (str() of each value). `num_gpu_blocks` is our total KV blocks, on
    whatever device holds them; `engine` is vLLM's engine index (one engine here)."""
    return {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
            "cache_dtype": cache_dtype, "enable_prefix_caching": str(prefix_caching),
            "cpu_offload_gb": str(cpu_offload_gb), "engine": "0"}


class ServerMetrics:
    """The registry behind /metrics and the per-request observations that feed it.
    `cache_config`: vllm:cache_config_info's labels (None: a model without a KV
    cache, no such series)."""

    def __init__(self, engine: Any, model_name: str,
                 cache_config: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        if cache_config is not None:
            Gauge("vllm:cache_config_info", "Information of the engine's KV cache config.",
                  list(cache_config), registry=r).labels(**cache_config).set(1)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by reason.",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the end of the request.", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to the first scheduling step.", labels,
                                    buckets=TTFT_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens",
                                               "Prompt length of each request.", labels,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens of each request.", labels,
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.registry.register(EngineCollector(engine, model_name))

    def observe_request(self, last_output: GenerationOutput | None, prompt_tokens: int,
                        generated_tokens: int, finished_reason: str) -> None:
        """Account for one engine request that has ended (finished, failed or
        cancelled). `last_output` is the newest output seen for it, if any."""
        m = self.model_name
        self.request_success.labels(m, finished_reason).inc()
        if last_output is None:
            return  # cancelled before its first token: no latency to report
        if last_output.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(
                last_output.first_scheduled_time - last_output.created_time)
        timestamps = last_output.timestamps or []
        if timestamps:  # the prompt was computed: it counts as prefill work
            self.prompt_tokens.labels(m).inc(prompt_tokens)
            self.request_prompt_tokens.labels(m).observe(prompt_tokens)
            self.ttft.labels(m).observe(timestamps[0] - last_output.created_time)
        for earlier, later in zip(timestamps, timestamps[1:]):
            self.itl.labels(m).observe(later - earlier)
        self.generation_tokens.labels(m).inc(generated_tokens)
        self.request_generation_tokens.labels(m).observe(generated_tokens)
        self.e2e.labels(m).observe(time.perf_counter() - last_output.created_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)

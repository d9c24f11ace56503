"""How big the KV cache and the per-step token budget are: what ContinuousBatchingConfig's
`num_blocks`, `max_memory_percent`, `max_batch_tokens` and `max_requests_per_batch`
resolve to when left unset (docs/configuration.md, "Engine knobs").

- Free memory: `torch.cuda.mem_get_info` on CUDA; psutil's available RAM on CPU.
- KV budget: `max_memory_percent` of free memory (0.9, or 0.8 when per-request
  logit processing is on). On CPU the default is further capped at
  CPU_DEFAULT_KV_CACHE_BYTES (2 GiB) so that a host running the server, tests and
  several engines in one process stays usable; an explicit `max_memory_percent` or
  `num_blocks` lifts the cap.
- `max_batch_tokens`: 8192 by default, capped so its activations take at most a tenth
  of the budget, never below 256.
- `max_requests_per_batch`: the number of submitted prompts when known, else 1024,
  then at most `max_batch_tokens` and `num_blocks`.
- CPU offload pool: `cpu_offload_space` GiB (None: as much as the threshold allows),
  clamped to `cpu_offload_space_safety_threshold` of system RAM, and to as many blocks
  as the device cache has (more could never be filled by one preemption wave).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from ..config import ContinuousBatchingConfig
from .paged_cache import PagedKVCache

CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
DEFAULT_MAX_BATCH_TOKENS = 8192
MAX_CONTEXT_FALLBACK = 32768
MIN_MAX_BATCH_TOKENS = 256


@dataclass(frozen=True)
class CacheSizing:
    num_blocks: int
    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int
    block_bytes: int
    num_sliding_blocks: int = 0
    """Blocks of the sliding-window layers' own pool (hybrid models only)."""

    @property
    def max_cached_tokens(self) -> int:
        return self.num_blocks * self.page_size


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def compute_sizing(config: ContinuousBatchingConfig, *, num_layers: int, num_kv_heads: int,
                   head_dim: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                   device: torch.device, logit_processing: bool,
                   num_submitted: int | None = None, num_sliding_layers: int = 0,
                   sliding_window: int | None = None, max_context: int | None = None,
                   activation_dtype: torch.dtype | None = None) -> CacheSizing:
    """`dtype` is the cache's element type, `activation_dtype` (default: the same) the
    model's activations'. `num_sliding_layers` > 0 gives those layers a pool of their own: enough for
    every request's window, within their share of memory. When every layer slides
    (Mistral), the full-attention blocks hold no memory and only count positions: a
    generous virtual pool (MAX_CONTEXT_FALLBACK tokens per request when the context is
    unknown) so requests are limited by their windows, not by it."""
    page_size = config.page_size
    num_full_layers = num_layers - num_sliding_layers
    block_bytes = PagedKVCache.bytes_per_block(num_full_layers, page_size, num_kv_heads,
                                               head_dim, dtype)
    budget = free_memory_bytes(device) * config.resolved_memory_percent(logit_processing)
    if device.type == "cpu" and config.max_memory_percent is None:
        budget = min(budget, CPU_DEFAULT_KV_CACHE_BYTES)

    element_size = torch.empty((), dtype=activation_dtype or dtype).element_size()
    activation_bytes_per_token = (4 * hidden_size + 3 * intermediate_size) * element_size
    max_batch_tokens = config.max_batch_tokens
    if max_batch_tokens is None:
        fitted = int(budget * 0.1 // activation_bytes_per_token)
        max_batch_tokens = max(MIN_MAX_BATCH_TOKENS, min(DEFAULT_MAX_BATCH_TOKENS, fitted))

    kv_budget = budget - max_batch_tokens * activation_bytes_per_token
    num_sliding_blocks = 0
    if sliding_window is not None and 0 < num_sliding_layers <= num_layers:
        sliding_block_bytes = PagedKVCache.bytes_per_block(
            num_sliding_layers, page_size, num_kv_heads, head_dim, dtype)
        per_request = -(-(sliding_window - 1) // page_size) + 1
        floor = -(-(sliding_window - 1 + max_batch_tokens) // page_size) + 1
        wanted = (config.max_requests_per_batch or num_submitted or 256) * per_request + floor
        share = kv_budget * num_sliding_layers / num_layers
        num_sliding_blocks = max(floor, min(wanted, int(share // sliding_block_bytes)))
        kv_budget -= num_sliding_blocks * sliding_block_bytes

    num_blocks = config.num_blocks
    if num_blocks is None and block_bytes == 0:
        per_request = -(-(max_context or MAX_CONTEXT_FALLBACK) // page_size)
        num_blocks = per_request * (config.max_requests_per_batch or num_submitted or 256)
    elif num_blocks is None:
        num_blocks = max(1, int(kv_budget // block_bytes))

    max_requests = config.max_requests_per_batch
    if max_requests is None:
        max_requests = num_submitted if num_submitted else 1024
        max_requests = max(1, min(max_requests, max_batch_tokens, num_blocks))
    return CacheSizing(num_blocks=num_blocks, page_size=page_size,
                       max_batch_tokens=max_batch_tokens,
                       max_requests_per_batch=max_requests, block_bytes=block_bytes,
                       num_sliding_blocks=num_sliding_blocks)


def offload_num_blocks(config: ContinuousBatchingConfig, sizing: CacheSizing) -> int:
    """Slots of the CPU offload pool (0 = offload off: preemption recomputes)."""
    space = config.cpu_offload_space
    if space == 0 or sizing.block_bytes == 0:
        return 0
    limit = config.cpu_offload_space_safety_threshold * psutil.virtual_memory().total
    budget = limit if space is None else min(space * 1024**3, limit)
    return max(0, min(int(budget // sizing.block_bytes), sizing.num_blocks))


FALLBACK_BLOCKS_PER_REQUEST = 32


def resolve_max_blocks_per_request(config: ContinuousBatchingConfig, page_size: int,
                                   workload_hints: dict) -> int:
    """Block-table width of the decode fast path: the configured value (0 disables
    it), else wide enough for the longest prompt + generation the hints announce,
    else FALLBACK_BLOCKS_PER_REQUEST."""
    if config.max_blocks_per_request is not None:
        return config.max_blocks_per_request
    longest = workload_hints.get("max_prompt_length")
    generated = workload_hints.get("max_generated_length")
    if longest and generated:
        return -(-(longest + generated) // page_size)
    return FALLBACK_BLOCKS_PER_REQUEST

"""ContinuousBatchingConfig: the hardware side of generation (memory, scheduling).

Frozen and validated once at construction; every error names the field. Values the
engine derives later (the number of blocks, the token budget) live in
`engine.kv_cache.sizing.CacheSizing`, never written back here.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass
from typing import Any

from .step.compile_paths import compile_settings
from .speculative.config import SpeculativeConfig

SCHEDULER_TYPES = ("fifo", "prefill_first")
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}


def _check(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"ContinuousBatchingConfig.{field_name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ContinuousBatchingConfig:
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    speculative_config: Any = None
    """Speculative decoding (speculative/config.py): a SpeculativeConfig, a dict of its
    fields or their JSON; None: off. Stored as a SpeculativeConfig."""
    use_default_compile_configs: InitVar[bool | None] = None
    """Deprecated: use `default_compile_level`."""
    max_cached_graphs: InitVar[int | None] = None
    """Deprecated: accepted and ignored."""
    block_size: InitVar[int | None] = None
    """Deprecated alias of `page_size`."""

    def __post_init__(self, use_default_compile_configs: bool | None,
                      max_cached_graphs: int | None, block_size: int | None) -> None:
        if use_default_compile_configs is not None or max_cached_graphs is not None:
            warnings.warn("ContinuousBatchingConfig.use_default_compile_configs and "
                          "max_cached_graphs are deprecated and ignored",
                          FutureWarning, stacklevel=3)
            if use_default_compile_configs and self.default_compile_level == 0:
                object.__setattr__(self, "default_compile_level", 1)
        if block_size is not None:
            warnings.warn(
                "ContinuousBatchingConfig.block_size is deprecated; use page_size",
                FutureWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "page_size", block_size)
        self._validate_sizes()
        self._validate_policies()
        try:
            speculative = SpeculativeConfig.from_any(self.speculative_config)
        except ValueError as error:
            raise ValueError(f"ContinuousBatchingConfig.{error}") from None
        object.__setattr__(self, "speculative_config", speculative)

    def _validate_sizes(self) -> None:
        _check(_is_int(self.page_size) and self.page_size >= 4, "page_size",
               f"must be an integer >= 4, got {self.page_size!r}")
        for name in ("num_blocks", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 1), name,
                   f"must be a positive integer or None, got {value!r}")
        _check(self.max_blocks_per_request is None
               or (_is_int(self.max_blocks_per_request) and self.max_blocks_per_request >= 0),
               "max_blocks_per_request", "must be a non-negative integer or None")
        _check(self.max_memory_percent is None or 0.0 < self.max_memory_percent <= 1.0,
               "max_memory_percent", f"must be in (0, 1], got {self.max_memory_percent!r}")
        for name in ("q_padding_interval_size", "kv_padding_interval_size", "max_queue_size"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name,
                   f"must be a non-negative integer, got {value!r}")
        _check(self.cpu_offload_space is None or self.cpu_offload_space >= 0,
               "cpu_offload_space", "must be >= 0 GiB or None")
        _check(0.0 <= self.cpu_offload_space_safety_threshold <= 1.0,
               "cpu_offload_space_safety_threshold", "must be in [0, 1]")
        _check(self.cpu_group_timeout is None or (
            isinstance(self.cpu_group_timeout, (int, float)) and self.cpu_group_timeout >= 5),
            "cpu_group_timeout", "must be None or >= 5 seconds (an idle engine's followers "
            "hear from the driver every few seconds)")

    def _validate_policies(self) -> None:
        _check(self.scheduler_type in SCHEDULER_TYPES, "scheduler_type",
               f"must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}")
        _check(self.safety_margin is None or 0.0 <= self.safety_margin <= 1.0,
               "safety_margin", f"must be in [0, 1], got {self.safety_margin!r}")
        _check(_is_int(self.default_compile_level) and 0 <= self.default_compile_level <= 3,
               "default_compile_level", "must be an integer in 0..3")
        for name in ("varlen_compile_config", "decode_compile_config"):
            compile_settings(getattr(self, name), name)     # raises naming the field
        _check(self.seed is None or _is_int(self.seed), "seed", "must be an integer or None")
        graph = self.use_cuda_graph
        _check(graph is None or isinstance(graph, bool)
               or (isinstance(graph, tuple) and len(graph) == 2
                   and all(isinstance(part, bool) for part in graph)), "use_cuda_graph",
               "must be None, a bool, or a (varlen, decode) pair of bools")

    @property
    def resolved_safety_margin(self) -> float:
        if self.safety_margin is not None:
            return self.safety_margin
        return DEFAULT_SAFETY_MARGIN[self.scheduler_type]

    def resolved_memory_percent(self, logit_processing: bool) -> float:
        if self.max_memory_percent is not None:
            return self.max_memory_percent
        return 0.8 if logit_processing else 0.9

    def replace(self, **changes: Any) -> "ContinuousBatchingConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_any(cls, value: Any) -> "ContinuousBatchingConfig":
        """Accept None, our config, a dict, or any object with matching attributes
        (such as transformers' ContinuousBatchingConfig)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(value, n) for n in names if hasattr(value, n)})

"""Which optional features a model and device get, decided once when a manager is
built, each refusal logged with its reason: prefix caching and CPU offload (off for
sliding-window models, whose sliding layers recycle pages in a pool of their own) and
the decode fast path (fixed-width block tables; no sliding layers) and the CUDA
graphs of its steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention.backend import AttentionBackend
from ..config import ContinuousBatchingConfig
from .decode_tables import DecodeTables, decode_tables_for
from ..model_spec import EngineModelSpec

logger = logging.getLogger(__name__)


def adjust_for_sliding(config: ContinuousBatchingConfig, sliding_window: int | None,
                       pooled: bool) -> ContinuousBatchingConfig:
    """Sliding layers recycle pages, so their blocks cannot be shared by prefix; their
    separate pool is not handled by CPU offload yet."""
    if sliding_window is None:
        return config
    if config.allow_block_sharing:
        logger.info("prefix caching off: the model has sliding-window layers")
        config = config.replace(allow_block_sharing=False)
    if pooled and config.cpu_offload_space != 0:
        logger.info("CPU offload off: sliding-window models are preempted by recompute")
        config = config.replace(cpu_offload_space=0.0)
    return config


def decode_fast_path(config: ContinuousBatchingConfig, max_blocks_per_request: int,
                     sliding_window: int | None, backend, device) -> bool:
    """Whether decode-only batches take fixed-width block tables: flash_attn_with_kvcache
    with the flash backend, fixed_table_decode with the torch backend on accelerators.
    Off when disabled (max_blocks_per_request=0), for sliding-window models, and for
    the torch backend on CPU (its native decode kernel is faster); the reason is
    logged as a warning only when the user set max_blocks_per_request."""
    if max_blocks_per_request == 0:
        return False
    reason = None
    if sliding_window is not None:
        reason = "the model has sliding-window layers"
    elif not backend.decode_fast_path_on(device):
        reason = f"the {backend.name} attention backend has none on {device.type}"
    if reason is None:
        return True
    log = logger.warning if config.max_blocks_per_request else logger.info
    log("decode fast path off: %s; decode batches use the varlen path", reason)
    return False


def decode_graphs(config: ContinuousBatchingConfig, fast_path: bool, device,
                  distributed: bool) -> str | None:
    """"capture" when decode steps get CUDA graphs (cuda_graphs.py), else None.
    `use_cuda_graph` None (auto) or True, or a (varlen, decode) pair whose decode part
    is, turns them on where they work: CUDA, the decode fast path, one process. Graphs
    of varlen steps are not built: those steps always run eagerly."""
    wanted = config.use_cuda_graph
    if isinstance(wanted, tuple):
        if wanted[0]:
            logger.info("CUDA graphs of varlen steps are not built; those steps run eagerly")
        wanted = wanted[1]
    if wanted is False:
        return None
    reason = None
    if device.type != "cuda":
        reason = "no CUDA device"
    elif not fast_path:
        reason = "the decode fast path is off"
    elif distributed:
        reason = "tensor parallelism"
    if reason is None:
        return "capture"
    (logger.warning if wanted else logger.debug)("CUDA graphs off: %s", reason)
    return None


def async_batching(config: ContinuousBatchingConfig, graphs: str | None, device,
                   distributed: bool) -> bool:
    """Whether decode steps are queued before the previous step's tokens are read
    back (async_steps.py). `use_async_batching` None (auto) turns it on where CUDA
    graphs replay decode steps (the host's scheduling is then the gap between
    steps); True anywhere but under tensor parallelism (followers could not gather
    the tokens on their own); on a CPU it only reorders the host's work."""
    wanted = config.use_async_batching
    if wanted is None:
        return graphs == "capture" and not distributed
    if wanted and distributed:
        logger.warning("async batching off: tensor parallelism")
        return False
    if wanted and device.type == "cpu":
        logger.info("async batching on a CPU: steps run as they are queued, nothing overlaps")
    return bool(wanted)


@dataclass(frozen=True)
class DecodePlan:
    backend: AttentionBackend
    """The attention backend of every step (the runner's)."""
    max_blocks_per_request: int
    tables: DecodeTables | None
    """The decode fast path's table widths, or None when the path is off."""
    graphs: str | None
    """"capture" when its steps get CUDA graphs."""


def plan_decode_paths(config: ContinuousBatchingConfig, module, spec: EngineModelSpec,
                      device: torch.device, page_size: int, kv_dtype: torch.dtype,
                      workload_hints: dict, distributed: bool) -> DecodePlan:
    """Per manager: the attention backend of its steps on `module` (on CUDA flash
    where it serves this page size, see attention/backend.py), then the decode fast path and its
    graphs, from the model's `spec`."""
    from ..attention.backend import choose_backend
    from ..kv_cache.sizing import resolve_max_blocks_per_request

    # each manager decides anew (its page size, its flag); CPU always takes torch
    backend = choose_backend(module, config.auto_switch_to_flash, page_size)
    max_blocks = resolve_max_blocks_per_request(config, page_size, workload_hints)
    on = decode_fast_path(config, max_blocks, spec.sliding_window, backend, device)
    tables = None
    if on:
        tables = decode_tables_for(backend.needs_block_tables, max_blocks, page_size,
                                   config.kv_padding_interval_size,
                                   spec.kv_bytes_per_token(kv_dtype))
    return DecodePlan(backend, max_blocks, tables, decode_graphs(config, on, device, distributed))

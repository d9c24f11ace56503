"""What an engine loop is built from, decided once per manager: the KV cache's sizing,
the block allocators and the scheduler, the decode and compile plans, and the model
runner that owns the cache tensors.

Under tensor parallelism the driver sizes the cache and every rank takes its figures
(a broadcast), so all ranks hold the same blocks; each rank builds its own runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compile_paths import plan_compile
from .config import ContinuousBatchingConfig
from .distributed import StepSync
from .feature_gates import DecodePlan, adjust_for_sliding, async_batching, plan_decode_paths
from .kv_cache.allocator import BlockAllocator
from .kv_cache.paged_cache import kv_cache_dtype
from .kv_cache.sizing import CacheSizing, compute_sizing, offload_num_blocks
from .runner import ModelRunner
from .scheduler import Scheduler


@dataclass
class EngineParts:
    step_sync: StepSync | None
    """The step messenger of a tensor-parallel model, else None."""
    sizing: CacheSizing
    allocator: BlockAllocator
    scheduler: Scheduler
    decode_plan: DecodePlan
    runner: ModelRunner
    async_batching: bool


def build_engine_parts(model, config: ContinuousBatchingConfig, workload_hints: dict,
                       logit_processing: bool) -> EngineParts:
    """`model`: an EngineModel (its `module`, `config`, `device`, `dtype`)."""
    module = model.module
    sliding_window = getattr(module, "sliding_window", None)
    layer_is_sliding = getattr(module, "layer_is_sliding", [False] * len(module.layers))
    # sliding layers get their own recycling pool (hybrid Gemma 3, all-sliding Mistral)
    pooled = sliding_window is not None and any(layer_is_sliding)
    config = adjust_for_sliding(config, sliding_window, pooled)
    step_sync = _step_sync(model, config)
    kv_dtype = kv_cache_dtype(model.device, model.dtype, getattr(module, "kv_cache_dtype", None))
    sized = None
    if step_sync is None or step_sync.is_driver:
        sizing = _size_cache(model, config, kv_dtype, workload_hints, logit_processing,
                             num_sliding_layers=sum(layer_is_sliding) if pooled else 0,
                             sliding_window=sliding_window if pooled else None)
        sized = (sizing, offload_num_blocks(config, sizing))
    if step_sync is not None:   # every rank sizes its cache like the driver's
        sized = step_sync.group.broadcast(sized)
    sizing, num_offload_blocks = sized
    allocator = BlockAllocator(sizing.num_blocks, enable_caching=config.allow_block_sharing)
    scheduler = Scheduler(
        allocator, sizing.page_size, sizing.max_batch_tokens, sizing.max_requests_per_batch,
        config.resolved_safety_margin, config.scheduler_type,
        offload_allocator=BlockAllocator(num_offload_blocks) if num_offload_blocks else None,
        sliding_allocator=BlockAllocator(sizing.num_sliding_blocks) if pooled else None,
        sliding_window=sliding_window)
    distributed = step_sync is not None
    decode_plan = plan_decode_paths(config, module, model.device, sizing.page_size, kv_dtype,
                                    workload_hints, distributed)
    compile_plan = plan_compile(config, model.device, module.attn_backend.needs_block_tables,
                                decode_plan.tables is not None, distributed)
    runner = ModelRunner(
        module, sizing, config.seed, num_offload_blocks, step_sync,
        decode_tables=decode_plan.tables, decode_graphs=decode_plan.graphs,
        graph_interval=config.q_padding_interval_size, compile_plan=compile_plan)
    return EngineParts(step_sync, sizing, allocator, scheduler, decode_plan, runner,
                       async_batching(config, decode_plan.graphs, model.device, distributed))


def _size_cache(model, config: ContinuousBatchingConfig, kv_dtype: torch.dtype,
                workload_hints: dict, logit_processing: bool, num_sliding_layers: int,
                sliding_window: int | None) -> CacheSizing:
    module, hf_config = model.module, model.config
    return compute_sizing(
        config, num_layers=len(module.layers), num_kv_heads=module.num_kv_heads,
        head_dim=module.head_dim, hidden_size=hf_config.hidden_size,
        intermediate_size=getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size),
        dtype=kv_dtype, activation_dtype=model.dtype, device=model.device,
        logit_processing=logit_processing, num_submitted=workload_hints.get("num_requests"),
        num_sliding_layers=num_sliding_layers, sliding_window=sliding_window,
        max_context=getattr(hf_config, "max_position_embeddings", None))


def _step_sync(model, config: ContinuousBatchingConfig) -> StepSync | None:
    """The step messenger of a tensor-parallel model (every rank gets a control group
    with this manager's `cpu_group_timeout`), else None."""
    group = getattr(model, "tp_group", None)
    if group is None:
        return None
    group.set_control_timeout(config.cpu_group_timeout)
    return StepSync(group, config.cpu_group_timeout)

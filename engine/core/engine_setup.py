"""What an engine loop is built from, decided once per manager: the KV cache's sizing,
the block allocators and the scheduler, the decode and compile plans, and the model
runner that owns the cache tensors.

Under tensor parallelism the driver sizes the cache and every rank takes its figures
(a broadcast), so all ranks hold the same blocks; each rank builds its own runner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..step.compile_paths import plan_compile
from ..config import ContinuousBatchingConfig
from ..distributed import StepSync
from ..step.feature_gates import DecodePlan, adjust_for_sliding, async_batching, plan_decode_paths
from ..kv_cache.allocator import BlockAllocator
from ..model_spec import EngineModelSpec
from ..kv_cache.sizing import CacheSizing, compute_sizing, offload_num_blocks
from ..step.runner import ModelRunner
from .scheduler import Scheduler
from ..speculative.choice import choose_proposer, refusal

logger = logging.getLogger(__name__)


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
    spec = module.engine_spec()
    # sliding layers get their own recycling pool (hybrid Gemma 3, all-sliding Mistral)
    pooled = spec.pooled_sliding
    config = adjust_for_sliding(config, spec.sliding_window, pooled)
    step_sync = _step_sync(model, config)
    kv_dtype = spec.kv_dtype(model.device, model.dtype)
    sized = None
    if step_sync is None or step_sync.is_driver:
        sizing = _size_cache(model, spec, config, kv_dtype, workload_hints, logit_processing)
        sized = (sizing, offload_num_blocks(config, sizing))
    if step_sync is not None:   # every rank sizes its cache like the driver's
        sized = step_sync.group.broadcast(sized)
    sizing, num_offload_blocks = sized
    allocator = BlockAllocator(sizing.num_blocks, enable_caching=config.allow_block_sharing)
    distributed = step_sync is not None
    decode_plan = plan_decode_paths(config, module, spec, model.device, sizing.page_size,
                                    kv_dtype, workload_hints, distributed)
    batching = async_batching(config, decode_plan.graphs, model.device, distributed)
    scheduler = Scheduler(
        allocator, sizing.page_size, sizing.max_batch_tokens, sizing.max_requests_per_batch,
        config.resolved_safety_margin, config.scheduler_type,
        offload_allocator=BlockAllocator(num_offload_blocks) if num_offload_blocks else None,
        sliding_allocator=BlockAllocator(sizing.num_sliding_blocks) if pooled else None,
        sliding_window=spec.sliding_window,
        proposer=choose_proposer(config.speculative_config, model, sizing,
                                 refusal(distributed, batching, spec.pooled_sliding)))
    compile_plan = plan_compile(config, model.device, decode_plan.backend.needs_block_tables,
                                decode_plan.tables is not None, distributed)
    runner = ModelRunner(
        module, sizing, config.seed, num_offload_blocks, step_sync,
        decode_tables=decode_plan.tables, decode_graphs=decode_plan.graphs,
        graph_interval=config.q_padding_interval_size, compile_plan=compile_plan,
        backend=decode_plan.backend)
    return EngineParts(step_sync, sizing, allocator, scheduler, decode_plan, runner, batching)


def _size_cache(model, spec: EngineModelSpec, config: ContinuousBatchingConfig,
                kv_dtype: torch.dtype, workload_hints: dict,
                logit_processing: bool) -> CacheSizing:
    pooled = spec.pooled_sliding
    return compute_sizing(
        config, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, dtype=kv_dtype,
        activation_dtype=model.dtype, device=model.device,
        logit_processing=logit_processing, num_submitted=workload_hints.get("num_requests"),
        num_sliding_layers=sum(spec.layer_is_sliding) if pooled else 0,
        sliding_window=spec.sliding_window if pooled else None, max_context=spec.max_context)


def _step_sync(model, config: ContinuousBatchingConfig) -> StepSync | None:
    """The step messenger of a tensor-parallel model (every rank gets a control group
    with this manager's `cpu_group_timeout`), else None."""
    group = model.tp_group
    if group is None:
        return None
    group.set_control_timeout(config.cpu_group_timeout)
    return StepSync(group, config.cpu_group_timeout)

"""From a model spec to a built model module: what load_model (model_api.py) runs
between reading the spec and wrapping the module in an EngineModel.

    opened = open_spec(spec, cache_dir, load_tokenizer=True)   # config, source, tokenizer
    plan, native = plan_for(dtype, opened, device, ...)          # load_plan.py's plan
    module = build_module(opened, plan, native, device, ...)     # weights, methods, paths

The source is a torch module given by the caller, a GGUF file (read in place, its
blocks parsed natively) or an HF directory; a family with our own decoder code is
built from its weights here, any other runs on transformers' modeling code.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..generation_config import GenerationConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedSpec:
    """A spec resolved: `source` is the module given, a GGUF path or an HF directory;
    `model_dir` holds the config and tokenizer (None for a module given);
    `tokenizer_loading` runs beside the weights' reading (None when not asked)."""
    config: Any
    source: Any
    model_dir: Path | None = None
    generation_config: GenerationConfig | None = None
    tokenizer_loading: concurrent.futures.Future | None = None

    def tokenizer(self) -> Any:
        """The tokenizer loaded beside the weights, or None when none was asked for."""
        return None if self.tokenizer_loading is None else self.tokenizer_loading.result()


def open_spec(spec: Any, cache_dir: Path | None, load_tokenizer: bool) -> OpenedSpec:
    """The config and source of `spec` (a torch module with a config, a built-in name,
    a GGUF, an HF directory or hub id: model_files.py), with the tokenizer loading
    on its own thread when `load_tokenizer`."""
    from .model_files import gguf_source, load_tokenizer as read_tokenizer, read_config
    from .model_files import resolve_model_dir

    if isinstance(spec, torch.nn.Module) and hasattr(spec, "config"):
        return OpenedSpec(spec.config, spec)
    model_dir = resolve_model_dir(str(spec), cache_dir)   # a GGUF's: config and tokenizer
    config = read_config(model_dir)
    loading = _in_background(read_tokenizer, model_dir) if load_tokenizer else None
    return OpenedSpec(config, gguf_source(str(spec), cache_dir) or model_dir, model_dir,
                      _generation_config_from(model_dir, config), loading)


def plan_for(dtype, opened: OpenedSpec, device: torch.device, tp_size: int,
             block_kernels: bool, kv_cache_dtype: str, cache_dir):
    """The load plan (load_plan.py) and, on CPU, the native kernels it was made for
    (None where they cannot be built)."""
    from ..kernels import load_native_kernels
    from ..models import has_own_code
    from .load_plan import CpuKernels, ModelSource, plan_load
    from .model_files import auto_dtype

    native = load_native_kernels(Path(cache_dir) if cache_dir else None) \
        if device.type == "cpu" else None
    source, config = opened.source, opened.config
    kind = ("module" if isinstance(source, torch.nn.Module)
            else "gguf" if source.suffix == ".gguf" else "hf")
    plan = plan_load(dtype, ModelSource(kind, has_own_code(config), config.model_type),
                     device.type, tp_size, block_kernels,
                     None if native is None else CpuKernels.of(native), kv_cache_dtype,
                     auto_dtype(config, device))
    return plan, native


def build_module(opened: OpenedSpec, plan, native, device: torch.device, tp_size: int,
                 cpu_group_timeout: float | None, progress: bool) -> torch.nn.Module:
    """The model module the plan describes, built whole: its weights read, in their
    linear methods, with its native executors (our families) and KV cache dtype."""
    from ..models import has_own_code
    from ..models.method_choice import LinearPlan, format_method_table, method_table

    source, config = opened.source, opened.config
    if not has_own_code(config):
        return _transformers_family(source, config, plan.compute, device, plan.kv_cache)
    kernels = native if plan.block_kernels else None
    single_cpu = device.type == "cpu" and tp_size == 1
    linear_plan = LinearPlan(plan.dtype.weights, pack=single_cpu, native_bf16=plan.native_bf16,
                             block_kernels=kernels, dense_table=plan.dense_table,
                             executor_kernels=native if single_cpu else None)
    kv_dtype = plan.kv_cache if plan.kv_cache is not None or plan.dtype.weights != "bf16" \
        else torch.bfloat16                  # bf16-weights: a bf16 cache unless one is asked
    try:
        weights = _read_weights(source, config, progress, kernels, plan.int8_activations)
        module = _own_family(weights, config, plan.compute, device, tp_size, cpu_group_timeout,
                             linear_plan, kv_dtype, isinstance(source, torch.nn.Module))
    except ModelLoadError:
        raise
    except (ValueError, KeyError, RuntimeError) as error:   # weights that do not fit
        if tp_size > 1:            # the config, or damaged; a TensorParallelError
            raise                  # (sharding, launch) says its own part
        raise _weights_refused(source, error) from error
    logger.info("linear methods:\n%s", format_method_table(method_table(module)))
    return module


def _weights_refused(source, error: Exception) -> ModelLoadError:
    """One line naming the weights' source and the first line of what went wrong
    (a shape that disagrees with the config, a missing tensor, a torch read error)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    where = "the model given" if isinstance(source, torch.nn.Module) else str(source)
    return ModelLoadError(f"{where}: its weights cannot be loaded "
                          f"({type(error).__name__}: {first})")


def _in_background(function, *args) -> concurrent.futures.Future:
    """function(*args) on a thread of its own. Loading a tokenizer is mostly importing
    transformers (Python, holding the interpreter lock), while reading a GGUF's blocks
    runs in native code that releases it: side by side they take the longer one's
    time, not the sum (docs/benchmarks.md, Start-up and real-size models)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-load")
    future = pool.submit(function, *args)
    pool.shutdown(wait=False)
    return future


def _read_weights(source, config, progress: bool, kernels, int8_activations: bool):
    """The dense state dict (transformers' names) of a model instance or directory,
    or the GGUFCheckpoint of a GGUF file (read in place; its blocks parsed by the
    native `kernels` where given, for int8 activations or not)."""
    from .model_files import read_state_dict
    from ..models.gguf_checkpoint import BlockParsing, read_gguf_checkpoint

    if isinstance(source, torch.nn.Module):
        return source.state_dict()
    if source.suffix == ".gguf":
        return read_gguf_checkpoint(source, config, BlockParsing(kernels, int8_activations))
    return read_state_dict(source, progress)


def _own_family(weights, config, dtype: torch.dtype, device: torch.device, tp_size: int,
                cpu_group_timeout: float | None, plan, kv_dtype: torch.dtype | None,
                given: bool):
    """One of our decoder implementations (models/__init__.py's registry) built from
    `weights` (a state dict, or a GGUFCheckpoint whose blocks the plan's block
    kernels serve where it has them: model_parts.py), sharded under tensor
    parallelism. `given`: the weights are a caller's module's, never shared."""
    from ..models import build_model
    from ..models.gguf_checkpoint import GGUFCheckpoint
    from ..models.model_parts import CheckpointTensors, ModelParts

    gguf = weights if isinstance(weights, GGUFCheckpoint) else None
    if tp_size > 1:
        state = weights if gguf is None else gguf.dense_state()
        return _build_sharded(config, state, dtype, device, tp_size, cpu_group_timeout, plan,
                              kv_dtype)
    if gguf is None:
        tensors = CheckpointTensors.of_state(weights, dtype, device, copy=given)
        return build_model(config, ModelParts(tensors, plan, None, kv_dtype))
    tensors = CheckpointTensors(gguf.take, dtype, device)
    blocks = gguf.blocks if plan.block_kernels is not None else None
    return build_model(config, ModelParts(tensors, plan, blocks, kv_dtype))


def _transformers_family(source, config, dtype: torch.dtype, device: torch.device,
                         kv_dtype: torch.dtype | None):
    """A family we have no code for, on transformers' modeling code with the paged
    attention (models/transformers_path.py); the plan has refused what it cannot do."""
    from ..models.transformers_path import load_transformers_model

    module = load_transformers_model(source, dtype, device, kv_dtype)
    logger.info("model_type %r runs on transformers' modeling code with the paged "
                "attention (no native decode kernels)", config.model_type)
    return module


def _build_sharded(config, state, dtype: torch.dtype, device: torch.device, tp_size: int,
                   timeout_s: float | None, plan, kv_dtype) -> torch.nn.Module:
    """This rank's shard of the model, read from the whole checkpoint on its device."""
    from ..distributed import check_shardable, init_tensor_parallel
    from ..models import build_model
    from ..models.model_parts import CheckpointTensors, ModelParts, Shard

    check_shardable(config, tp_size)          # before joining: a bad size fails at once
    group = init_tensor_parallel(tp_size, device, timeout_s)
    tensors = CheckpointTensors.of_state(state, dtype, group.device,
                                         shard=Shard(group.rank, group.world_size))
    return build_model(config, ModelParts(tensors, plan, None, kv_dtype, group))


def _generation_config_from(model_dir: Path, config) -> GenerationConfig | None:
    """The model's own EOS ids from generation_config.json when it has one: they can
    differ from config.json's (Llama 3 Instruct also stops at <|eot_id|>), and
    transformers' generate stops at them. Sampling defaults there are not adopted:
    the engine stays greedy unless asked."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    from transformers import GenerationConfig as HFGenerationConfig

    eos = HFGenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    return GenerationConfig(eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else eos)

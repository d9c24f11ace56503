"""EngineModel: a loaded model with the continuous-batching entry points of
transformers' API (`generate_batch`, `init_continuous_batching`,
`continuous_batching_context_manager`), and `load_model`, which builds one."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from .config import ContinuousBatchingConfig
from .generation_config import GenerationConfig, resolve_eos, unsupported_settings
from .structured.grammar import GrammarCompiler
from .loading.model_files import without_gc
from .outputs import GenerationOutput

logger = logging.getLogger(__name__)


class EngineModel:
    def __init__(self, module: torch.nn.Module, config: Any, tokenizer: Any = None,
                 generation_config: GenerationConfig | None = None) -> None:
        self.module = module
        self.config = config
        self.tokenizer = tokenizer
        parameter = next(module.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        eos = getattr(config, "eos_token_id", None)
        if eos is None and tokenizer:
            eos = tokenizer.eos_token_id
        self.generation_config = generation_config or GenerationConfig(eos_token_id=eos)
        self._kept_manager = None
        self.grammars = GrammarCompiler(tokenizer, int(config.vocab_size),
                                        resolve_eos(self.generation_config.eos_token_id, None))
        """Compiles `grammar=` specs against this model's tokenizer (grammar.py); one
        per model, so the tokenizer's index is built once however many managers run."""
        self.tp_group = module.tp_group
        """TensorParallelGroup when the weights are sharded over torchrun ranks."""

    @property
    def kept_manager(self):
        """The manager kept by `stop(keep_for_next_session=True)`, which the next
        `init_continuous_batching` without a new config reuses; None when none is."""
        return self._kept_manager

    def keep_manager(self, manager) -> None:
        self._kept_manager = manager

    def forget_manager(self, manager) -> None:
        """`manager` was destroyed: no longer kept (another kept one stays)."""
        if self._kept_manager is manager:
            self._kept_manager = None

    def load_beside(self, spec: Any) -> "EngineModel":
        """Another model on this one's device (a speculative draft: draft_model.py),
        loaded here so the engine's parts never import the loader back."""
        return load_model(spec, device=self.device, progress=False)

    @property
    def generates(self) -> bool:
        """Whether the model can generate text: a sequence classifier has no LM head."""
        return self.module.engine_spec().num_labels is None

    def _resolve_generation_config(self, generation_config) -> GenerationConfig:
        if generation_config is None:
            return self.generation_config
        config = GenerationConfig.from_any(generation_config)
        if config.eos_token_id is None and self.generation_config.eos_token_id is not None:
            config = config.replace(eos_token_id=self.generation_config.eos_token_id)
        return config

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints: dict | None = None, **_: Any):
        """A manager for this model; the caller starts and stops it. A manager kept
        with `stop(keep_for_next_session=True)` is reused when no new config is given."""
        from .manager import ContinuousBatchingManager

        cached = self._kept_manager
        if cached is not None and generation_config is None and continuous_batching_config is None:
            return cached
        continuous_batching_config = ContinuousBatchingConfig.from_any(continuous_batching_config)
        dropped = unsupported_settings(generation_config)
        if dropped and not continuous_batching_config.drop_unsupported_processors:
            raise ValueError(f"generation_config asks for {', '.join(dropped)}, which continuous "
                             "batching does not run (drop_unsupported_processors=True drops them "
                             "with a warning)")
        if dropped:
            logger.warning("generation_config: %s not supported by continuous batching: dropped",
                           ", ".join(dropped))
        if cached is not None:
            cached.destroy()
        return ContinuousBatchingManager(
            self, self._resolve_generation_config(generation_config),
            continuous_batching_config, workload_hints)

    @contextlib.contextmanager
    def continuous_batching_context_manager(self, generation_config=None, block: bool = True,
                                            timeout: float | None = None,
                                            continuous_batching_config=None,
                                            persistent_manager: bool = False, warmup: bool = True,
                                            workload_hints: dict | None = None):
        """Warm up (`warmup`: a dummy batch, the decode CUDA graphs where there are any)
        and start a manager on enter; on exit stop it (`block`, `timeout` as `stop`'s),
        and destroy it unless `persistent_manager` (then it is kept on the model for the
        next session)."""
        manager = self.init_continuous_batching(generation_config, continuous_batching_config,
                                                workload_hints=workload_hints)
        if warmup and not manager.warmed_up:
            manager.warmup()
        manager.start()
        try:
            yield manager
        finally:
            manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
            if not persistent_manager:
                manager.destroy()

    def generate_batch(self, inputs: list[list[int]], generation_config=None,
                       continuous_batching_config=None, record_timestamps: bool = False,
                       progress_bar: bool = False, persistent_manager: bool = False,
                       warmup: bool = True, **kwargs: Any) -> dict[str, GenerationOutput]:
        """Generate for every prompt; blocks until all are done. Returns outputs keyed
        by request id, in the order of `inputs`. Under tensor parallelism every rank
        calls it with the same arguments and every rank returns the outputs."""
        if not inputs:
            return {}                    # no manager, no cache for no work
        hints = {"num_requests": len(inputs),
                 "max_prompt_length": max((len(i) for i in inputs), default=0),
                 "max_generated_length": kwargs.get("max_new_tokens") or GenerationConfig.from_any(
                     generation_config or self.generation_config).max_new_tokens}
        manager = self.init_continuous_batching(generation_config, continuous_batching_config,
                                                workload_hints=hints)
        manager.start()
        failed = False
        try:
            if warmup and not manager.warmed_up:
                manager.warmup()
            outcome = (self._collect(manager, inputs, record_timestamps, progress_bar, kwargs)
                       if manager.is_driver else manager.join())
        except BaseException as error:   # under TP the followers still need an answer
            failed = True
            if self.tp_group is None:
                raise
            outcome = error
        finally:
            # after a failure (a bad prompt, Ctrl-C) what is queued is not waited for
            manager.stop(block=True, keep_for_next_session=persistent_manager,
                         hard_stop=failed and self.tp_group is None)
            if not persistent_manager:
                manager.destroy()
        if self.tp_group is not None:    # every rank returns the driver's outputs
            shared = self.tp_group.broadcast(
                RuntimeError(f"generate_batch failed on the driver rank: {outcome!r}")
                if isinstance(outcome, BaseException) else outcome)
            outcome = outcome if manager.is_driver else shared
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @staticmethod
    def _collect(manager, inputs, record_timestamps: bool, progress_bar: bool,
                 kwargs: dict) -> dict[str, GenerationOutput]:
        from tqdm.auto import tqdm

        results: dict[str, GenerationOutput] = {}
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens,
                                   record_timestamps=record_timestamps, **kwargs)
        with tqdm(total=len(ids), disable=not progress_bar, desc="Generating") as bar:
            while len(results) < len(ids):
                result = manager.get_result(timeout=0.5)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
                elif result is None and not manager.is_running():
                    raise RuntimeError("the engine thread stopped before all requests finished")
        return {rid: results[rid] for rid in ids}

    @torch.inference_mode()
    def prompt_logits(self, input_ids: list[int], page_size: int = 16,
                      backend: str | None = None) -> torch.Tensor:
        """fp32 logits [len(input_ids), vocab] of one prompt through the paged path, on
        the attention `backend` named (None: the one an engine would choose)."""
        if self.tp_group is not None:
            raise RuntimeError("prompt_logits runs on a single process, not under tensor parallelism")
        from .generation_config import SamplingParams
        from .kv_cache.allocator import BlockAllocator
        from .kv_cache.sizing import CacheSizing
        from .core.requests import RequestState
        from .step.runner import ModelRunner
        from .core.scheduler import ScheduledBatch, ScheduledRequest, blocks_needed

        from .attention.backend import choose_backend, get_backend

        chosen = (choose_backend(self.module, True, page_size) if backend is None
                  else get_backend(backend))
        num_blocks = blocks_needed(len(input_ids), page_size)
        sizing = CacheSizing(num_blocks, page_size, len(input_ids), 1, 0)
        runner = ModelRunner(self.module, sizing, seed=0, backend=chosen)
        request = RequestState("logits", list(input_ids), 1, (), SamplingParams())
        request.block_ids = BlockAllocator(num_blocks).allocate(num_blocks)
        batch = ScheduledBatch([ScheduledRequest(request, 0, len(input_ids), True)], [])
        return runner.prompt_logits(batch)


@without_gc
def load_model(spec: Any, dtype: Any = "float32", device: Any = "cpu",
               cache_dir: str | Path | None = None, progress: bool = True,
               tokenizer: Any = None, tp_size: int = 1,
               cpu_group_timeout: float | None = 300.0,
               block_kernels: bool = True, kv_cache_dtype: str = "auto") -> EngineModel:
    """Load a model for the engine; see engine.loading.model_files for the accepted specs. An
    encoder checkpoint (BERT-like: encoder.ENCODER_MODEL_TYPES) gives an EncoderModel,
    which serves embedding requests only (engine/encoder).

    `dtype`: "auto" (on CPU int8-activations for a GGUF file where an int8 vector loop
    is built, else float32: loading/load_plan.py; the checkpoint's bf16/fp16 on accelerators,
    else bf16: loading/model_files.py's auto_dtype), "float32", "bfloat16", "float16", "bf16-weights",
    "int8-weights" (models/mixed_precision.py) or "int8-activations" (a GGUF on CPU:
    its blocks multiply activations quantized to int8 per 32 values, as llama.cpp
    does; models/int8_blocks.py).

    `kv_cache_dtype`: "float32", "bfloat16", or "auto": bf16 for dtype bf16-weights,
    else fp32 on CPU and the model's dtype on accelerators. A bf16 cache holds twice
    the tokens and halves what decode attention reads (its arithmetic stays fp32).

    `block_kernels`: for a GGUF model in float32 (or bf16-weights) on CPU, decode steps multiply
    straight from the file's own blocks (Q4_1, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K: the same
    weights in a fifth of the bytes or fewer; Q5_1, Q5_K in a third; fp32 arithmetic; see
    models/block_weights.py); False keeps dense matmuls
    everywhere (bit-level parity with transformers' fp32 matmuls).

    `tp_size` > 1 shards the weights over that many processes, which must have been
    started by `torchrun --nproc-per-node tp_size` (see engine/distributed); on CUDA
    each rank uses the GPU of its LOCAL_RANK."""
    from .encoder import is_encoder_config, load_encoder
    from .kernels.cpu_threads import release_openmp_pool
    from .loading.assemble import build_module, open_spec, plan_for
    from .loading.load_plan import dtype_mode
    from .loading.model_files import check_quantization, return_freed_memory
    from .models.classifier_head import check_classifier_family

    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    dtype_mode(dtype)                         # a bad name fails before anything is read
    device = torch.device(device)
    started = time.perf_counter()
    opened = open_spec(spec, Path(cache_dir) if cache_dir else None, tokenizer is None)
    if opened.model_dir is not None and is_encoder_config(opened.config):
        return load_encoder(opened.model_dir, opened.config, dtype, device,   # BERT-like
                            tokenizer or opened.tokenizer(), tp_size)
    check_quantization(opened.config)
    check_classifier_family(opened.config)
    plan, native = plan_for(dtype, opened, device, tp_size, block_kernels, kv_cache_dtype,
                            cache_dir)
    logger.info("load plan:\n%s", plan.table())
    module = build_module(opened, plan, native, device, tp_size, cpu_group_timeout, progress)
    model = EngineModel(module, opened.config, tokenizer or opened.tokenizer(),
                        opened.generation_config)
    logger.info("model loaded in %.1f s", time.perf_counter() - started)
    release_openmp_pool()      # the loading ran torch ops on this thread (cpu_threads.py)
    return_freed_memory()      # what loading freed, back to the system
    return model

"""ModelRunner: owns the KV cache tensors and runs one scheduled batch through the
model and the sampler. Called only from the engine thread (or under the manager's
step lock)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .batch import AttentionGroups, FastPathBuilder, StepInputs, build_step_inputs
from .compile_paths import CompilePlan, compiled_steps
from .cuda_graphs import DecodeGraphs
from .decode_tables import DecodeTables
from ..structured.grammar_masks import NO_MASKS, GrammarMasks, PendingMasks, apply_masks
from .pooling_step import pooled_parts
from ..attention.backend import AttentionBackend, get_backend
from ..distributed import StepPlan, StepSync, to_device
from ..kv_cache.paged_cache import PagedKVCache, copy_blocks, copy_slots
from ..kv_cache.sizing import CacheSizing
from ..kernels import load_native_kernels
from ..models.block_weights import PANEL_KERNEL_ROWS, BlockLinear
from ..core.requests import RequestState
from .sampling import PendingSample, SampleResult, Sampler, greedy_picks, on_device
from ..core.scheduler import ScheduledBatch, ScheduledRequest
from ..speculative.acceptance import Verdict


SMALL_STEP_TOKENS = 8
"""Steps feeding at most this many tokens run on one CPU thread (see _set_threads_for)."""
DEFAULT_THREADS = torch.get_num_threads()
"""torch's thread count at start, before any runner lowered it for a small step."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, sizing: CacheSizing, seed: int | None,
                 num_offload_blocks: int = 0, step_sync: StepSync | None = None,
                 decode_tables: DecodeTables | None = None, decode_graphs: str | None = None,
                 graph_interval: int = 0, compile_plan: CompilePlan | None = None,
                 backend: AttentionBackend | None = None, executors=None) -> None:
        """`decode_tables`: the decode fast path's table widths when it is on
        (decode_tables.py). `decode_graphs`: "capture" (CUDA graphs of fast-path decode
        steps), "eager" (the same padded static-buffer steps without graphs: tests) or
        None; they add one scratch block to the cache (cuda_graphs.py). `compile_plan`:
        which paths run compiled layer steps (compile_paths.py). `backend`: the
        attention backend of every step (attention/backend.py's choice; None: torch).
        `executors`: the native layer paths in place of the model's own (models/
        executors.py; bench.step's layer loop), or None."""
        parameter = next(model.parameters())
        self.model = model
        self.backend = backend or get_backend("torch")
        """Passed into each forward; the model holds no backend of its own."""
        self.executors = executors
        self.step_sync = step_sync
        """Under tensor parallelism: the driver sends each step's plan through it,
        a follower runs `follow()` instead of `step()`."""
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.page_size = sizing.page_size
        spec = model.engine_spec()
        self.kv_dtype = spec.kv_dtype(self.device, self.dtype)
        sliding_pool = bool(sizing.num_sliding_blocks)
        self.groups = AttentionGroups(spec.has_full_layers, spec.sliding_window,
                                      _sliding_blocks if sliding_pool else None)
        scratch_blocks = 1 if decode_graphs and decode_tables else 0   # graphs' padding page
        self.cache, self.offload_cache = _paged_caches(spec, sizing, self.kv_dtype, self.device,
                                                       scratch_blocks, num_offload_blocks)
        self.sampler = Sampler(self.device, seed)
        self.grammar_masks = GrammarMasks(self.device)
        self.max_threads = DEFAULT_THREADS
        self.small_step_tokens = _small_step_tokens(model)
        self.native_kernels = load_native_kernels() if self.device.type == "cpu" else None
        # short prefill chunks run as per-row queries of the native attention kernel
        # (attention/torch_metadata.py) only where its vector path serves the head size
        step_queries = (self.native_kernels is not None
                        and self.native_kernels.vector_attention(spec.head_dim))
        builder = self.backend.metadata_builder(sizing.page_size, step_queries)
        attention_dtype = torch.promote_types(self.dtype, self.kv_dtype)
        self.metadata_builder = builder if decode_tables is None else FastPathBuilder(
            builder, decode_tables, sizing.page_size, self.backend, attention_dtype)
        """Each step's attention metadata: the backend's builder, under the decode fast
        path's when it is on."""
        self.varlen_step, self.decode_step = compiled_steps(compile_plan or CompilePlan())
        self.num_compiled_steps = 0
        """Steps whose layers ran compiled code (graph replays not counted)."""
        self.decode_graphs = None if not (decode_graphs and decode_tables) else DecodeGraphs(
            model, self.cache, sizing.max_requests_per_batch, decode_tables,
            scratch_block=sizing.num_blocks, interval=graph_interval,
            capture=decode_graphs == "capture", layer_step=self.decode_step,
            backend=self.backend, attention_dtype=attention_dtype)

    def _set_threads_for(self, num_tokens: int) -> None:
        """On CPU, steps of a few tokens run faster on one intra-op thread: their
        matmuls are memory-bound and each of the step's ~600 ops would otherwise pay
        to wake the other thread. Larger steps are compute-bound and use all."""
        if self.device.type != "cpu" or self.max_threads == 1:
            return
        wanted = 1 if num_tokens <= self.small_step_tokens else self.max_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        if self.native_kernels is not None:   # its helpers would take torch's cores
            self.native_kernels.set_torch_threaded(wanted > 1)

    def step(self, batch: ScheduledBatch) -> tuple[list[RequestState], SampleResult | None]:
        """Run `batch`; returns the requests that sampled a token and their results."""
        launched = self.launch(batch)
        return launched.requests, launched.result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, inputs: StepInputs | None = None) -> "LaunchedStep":
        """Queue `batch`'s copies, forward pass, logits and picks on the device without
        reading anything back (on a CPU it all runs now). `inputs`: prepared ones
        (lookahead_inputs), else built here."""
        if inputs is None and batch.entries:
            inputs = self._inputs(batch)
        plan = StepPlan(list(batch.swap_out), list(batch.swap_in), inputs,
                        list(batch.prefix_copies))
        if self.step_sync is not None:
            self.step_sync.send_plan(plan)
        requests = [] if inputs is None else \
            [batch.entries[i].request for i in inputs.sampling_entries]
        verifying = [] if inputs is None else [batch.entries[i] for i in inputs.verify_entries]
        pooling = () if inputs is None else inputs.pooling_entries
        # grammar masks are computed while the forward pass runs (grammar_masks.py)
        masks = self.grammar_masks.start(requests, verifying) if requests or verifying \
            else NO_MASKS
        hidden = self._run_plan(plan)
        pooled = [] if hidden is None else pooled_parts(hidden, batch, pooling)
        done = [batch.entries[i] for i, _ in pooling if batch.entries[i].samples]
        if hidden is None or not (requests or verifying):
            masks.wait()
            return LaunchedStep([], None, pooled=pooled, pooling_done=done)
        logits = self.model.compute_logits(hidden[plan.inputs.logits_rows])   # [S + V, vocab]
        sample = None
        if requests:
            sample = self.sampler.launch(logits[:len(requests)], requests, masks)
        else:
            masks.wait()
        verdicts = self._verdicts(logits[len(requests):], verifying, masks) if verifying else []
        return LaunchedStep(requests, sample, verdicts, pooled, done)

    def _verdicts(self, logits: torch.Tensor, verifying: list[ScheduledRequest],
                  masks: PendingMasks) -> list:
        """(entry, Verdict) of each verify entry, from its rows of `logits` [V, vocab],
        a constrained entry's rows masked by its grammar first, as each row would be
        when decoded plainly."""
        spans = self._verify_spans(verifying)
        for index, rows in spans.items():
            bitmask = self.grammar_masks.verify_masks(masks, index)
            if bitmask is not None:
                logits[rows] = apply_masks(logits[rows], list(range(bitmask.shape[0])), bitmask)
        greedy, found = greedy_picks(logits).tolist(), []
        for index, rows in spans.items():
            entry = verifying[index]
            found.append((entry, self.sampler.verify(logits[rows], entry.request, entry.drafts,
                                                     greedy[rows])))
        return found

    @staticmethod
    def _verify_spans(verifying: list[ScheduledRequest]) -> dict[int, slice]:
        """Each verify entry's rows among the step's verify logits, in order."""
        spans, row = {}, 0
        for index, entry in enumerate(verifying):
            spans[index] = slice(row, row + entry.num_tokens)
            row += entry.num_tokens
        return spans

    @torch.inference_mode()
    def lookahead_inputs(self, batch: ScheduledBatch, previous: "LaunchedStep") -> StepInputs:
        """Inputs of a decode batch whose every request feeds the token `previous`
        picks for it, before that token is read back (async batching): built on the
        host with a placeholder, moved without waiting, the tokens gathered on the
        device from `previous`'s picks."""
        row_of = {id(request): row for row, request in enumerate(previous.requests)}
        rows = [row_of[id(entry.request)] for entry in batch.entries]
        inputs = self._inputs(batch, torch.device("cpu"))
        if self.device.type != "cpu":
            inputs = to_device(inputs, self.device)
        return replace(inputs, input_ids=previous.sample.token_ids[on_device(rows, self.device)])

    @torch.inference_mode()
    def follow(self) -> None:
        """Follower rank: run the driver's plans until it stops the engine."""
        while (plan := self.step_sync.receive()) is not None:
            self._run_plan(plan)

    def _run_plan(self, plan: StepPlan) -> torch.Tensor | None:
        """Copy offloaded blocks, then run the forward: final hidden states [T, hidden]."""
        inputs = plan.inputs
        if self.step_sync is not None and inputs is not None and self.device.type != "cpu":
            inputs = to_device(inputs, self.device)     # plans travel on the host
        self._set_threads_for(0 if inputs is None else inputs.input_ids.numel())
        if plan.swap_out or plan.swap_in:
            copy_blocks(self.cache, self.offload_cache, plan.swap_out)
            copy_blocks(self.offload_cache, self.cache, plan.swap_in)
        if plan.prefix_copies:
            copy_slots(self.cache, plan.prefix_copies)
        if inputs is None:
            return None
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(inputs.meta, inputs.input_ids.numel()):
            return graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        step = self.decode_step if inputs.meta.decode_fast_path else self.varlen_step
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache, inputs.meta,
                            self.backend, layer_step=step, executors=self.executors)
        if step is not None and not step.failed:
            self.num_compiled_steps += 1
        return hidden

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Record every decode graph now (the manager's warmup); returns how many."""
        return 0 if self.decode_graphs is None else self.decode_graphs.capture_all()

    def _inputs(self, batch: ScheduledBatch, device: torch.device | None = None) -> StepInputs:
        if device is None:
            device = self.device if self.step_sync is None else torch.device("cpu")
        return build_step_inputs(batch, device, self.metadata_builder, self.groups)

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """A pooled final hidden state [hidden] (fp32) -> the model's classification
        head's fp32 logits [num_labels] (pooling.py, `classify`; only models whose
        spec has num_labels)."""
        return self.model.compute_scores(pooled.to(self.dtype)[None])[0]

    @torch.inference_mode()
    def prompt_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of every position of the batch's tokens [T, vocab] (parity checks)."""
        inputs = self._inputs(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache, inputs.meta,
                            self.backend)
        return self.model.compute_logits(hidden)


@dataclass(frozen=True)
class LaunchedStep:
    requests: list[RequestState]
    """The requests that pick a token, in the picks' order."""
    sample: PendingSample | None
    verified: list[tuple[ScheduledRequest, Verdict]] = ()
    """Each entry with drafts and what its verify rows decided (on the host)."""
    pooled: list[tuple[ScheduledRequest, torch.Tensor]] = ()
    """Each embedding request's chunk and its part of the pooled state
    (pooling_step.pooled_parts)."""
    pooling_done: list[ScheduledRequest] = ()
    """The embedding requests' chunks that ended their prompt this step."""

    def result(self) -> SampleResult | None:
        """The picks on the host (waits for the device)."""
        return None if self.sample is None else self.sample.result()


def _sliding_blocks(request: RequestState) -> list[int | None]:
    return request.sliding_block_ids


def _paged_caches(spec, sizing: CacheSizing, kv_dtype: torch.dtype, device: torch.device,
                  scratch_blocks: int, num_offload_blocks: int):
    """The step's KV cache (sliding layers in their own smaller pool where the sizing
    gives one; `scratch_blocks` for the graphs' padding page) and the host pool that
    offloaded blocks go to (None without offloading)."""
    sliding_pool = bool(sizing.num_sliding_blocks)
    layer_num_blocks = [sizing.num_sliding_blocks if sliding_pool and sliding
                        else sizing.num_blocks + scratch_blocks
                        for sliding in spec.layer_is_sliding]
    cache = PagedKVCache(
        num_layers=spec.num_layers, num_blocks=sizing.num_blocks + scratch_blocks,
        page_size=sizing.page_size, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, dtype=kv_dtype, device=device,
        layer_num_blocks=layer_num_blocks)
    offload_cache = None
    if num_offload_blocks:
        offload_cache = PagedKVCache(
            num_layers=spec.num_layers, num_blocks=num_offload_blocks,
            page_size=sizing.page_size, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, dtype=kv_dtype, device=torch.device("cpu"),
            pin_memory=device.type == "cuda")
    return cache, offload_cache


def _small_step_tokens(model: torch.nn.Module) -> int:
    """Steps up to this many tokens run on one intra-op thread. On the block kernels
    they leave the other cores to the kernel's helpers; larger ones run the packed
    dense matmuls on every thread (bf16-weights' 6-8 row steps already gain from the
    second one)."""
    kernel_rows = [m.max_rows for m in model.layers.modules() if isinstance(m, BlockLinear)]
    return min(max(kernel_rows), PANEL_KERNEL_ROWS) if kernel_rows else SMALL_STEP_TOKENS

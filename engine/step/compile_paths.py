"""torch.compile of the decoder layer, per path: varlen steps (prefill chunks, mixed
and CPU decode batches) and decode fast-path steps (fixed-width block tables; on
accelerators, and inside their CUDA graphs).

The unit compiled is one layer's `torch_step` (models/llama.py, models/gemma3.py):
it takes the layer's cache pages as arguments and reads no layer index, so one
compiled copy serves every layer. Compiling the whole forward instead unrolls the
30 layers of the default model into one graph, whose first compilation takes far
longer than the layer's.

Settings come from `varlen_compile_config` / `decode_compile_config` (a transformers
`CompileConfig`, a dict of the same keys, or `CompileSettings`), or else from
`default_compile_level`:

    level 0: nothing compiled
    level 1: mode "default", dynamic shapes
    level 2: mode "max-autotune-no-cudagraphs", dynamic shapes
    level 3: mode "max-autotune-no-cudagraphs", static shapes (a compile per shape)

The torch backend's varlen attention runs outside the graphs (compile_boundary in
torch_backend.py), so how many prefill chunks a step holds, and where they start,
build no new ones; what still does: the CPU's thread count, one-row steps (torch
specialises a size of 1), and every shape under static shapes. Past torch's
recompile limit (8 graphs a function) new kinds run eagerly, which torch logs. The
frames a varlen step compiles after the boundary (the layer's torch_step, its
attention module, the backend, and where each resumes) are shared code, so they
share that limit across settings and models in one process.

The level gives settings only where compiling pays: on accelerators, and not to
the varlen path of the flash backend (its max_seqlen_k changes every step). On CPU
the engine's native kernels beat the compiled torch ops (docs/benchmarks.md,
Compiled layer steps on CPU): a level is logged and ignored there, explicit configs
are honoured. A decode config
needs the decode fast path; under tensor parallelism nothing is compiled.

A compilation that fails (no C++ compiler for inductor on CPU, an op it cannot
trace under fullgraph) turns its path back to eager for good, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..attention.torch_backend import compile_boundary
from ..kernels.isa import torch_held_below_cpu

logger = logging.getLogger(__name__)

LEVEL_MODES = {1: "default", 2: "max-autotune-no-cudagraphs", 3: "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class CompileSettings:
    """torch.compile's arguments for one path."""
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str | Callable = "inductor"
    mode: str | None = None
    options: dict | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic,
                "backend": self.backend, "mode": self.mode, "options": self.options}


def compile_settings(value: Any, field_name: str) -> CompileSettings | None:
    """None, CompileSettings, a dict of its fields, or an object with them (such as
    transformers' CompileConfig) -> CompileSettings; ValueError naming the field."""
    if value is None or isinstance(value, CompileSettings):
        return value
    names = [f.name for f in dataclasses.fields(CompileSettings)]
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"ContinuousBatchingConfig.{field_name}: unknown keys {unknown}; "
                             f"accepted: {names}")
        fields = dict(value)
    elif all(hasattr(value, name) for name in ("fullgraph", "dynamic", "backend", "mode")):
        fields = {name: getattr(value, name) for name in names if hasattr(value, name)}
    else:
        raise ValueError(f"ContinuousBatchingConfig.{field_name}: must be a CompileConfig, "
                         f"a dict of torch.compile arguments or None, got {value!r}")
    settings = CompileSettings(**fields)
    if settings.mode is not None and settings.options:
        raise ValueError(f"ContinuousBatchingConfig.{field_name}: torch.compile takes "
                         "`mode` or `options`, not both")
    if not (isinstance(settings.backend, str) or callable(settings.backend)):
        raise ValueError(f"ContinuousBatchingConfig.{field_name}: backend must be a name "
                         f"or a callable, got {settings.backend!r}")
    return settings


def level_settings(level: int) -> CompileSettings | None:
    if level == 0:
        return None
    return CompileSettings(mode=LEVEL_MODES[level], dynamic=level <= 2)


@dataclass(frozen=True)
class CompilePlan:
    varlen: CompileSettings | None = None
    decode: CompileSettings | None = None


def plan_compile(config, device: torch.device, flash_varlen: bool, fast_path: bool,
                 distributed: bool) -> CompilePlan:
    """Which paths compile, and how; every refusal logged with its reason."""
    varlen = compile_settings(config.varlen_compile_config, "varlen_compile_config")
    decode = compile_settings(config.decode_compile_config, "decode_compile_config")
    level = level_settings(config.default_compile_level)
    if level is not None and device.type == "cpu":
        logger.info("default_compile_level %d gives no compile settings on CPU: the native "
                    "kernels are faster than compiled torch ops there",
                    config.default_compile_level)
    elif level is not None:
        varlen = varlen if varlen is not None or flash_varlen else level
        decode = decode if decode is not None else level
    if varlen is not None and varlen.fullgraph and not flash_varlen:
        # the torch backend's varlen attention is a graph break (compile_boundary)
        logger.info("varlen_compile_config: fullgraph off; varlen attention runs between "
                    "the layer's compiled graphs")
        varlen = dataclasses.replace(varlen, fullgraph=False)
    if decode is not None and not fast_path:
        if config.decode_compile_config is not None:
            logger.warning("decode_compile_config ignored: the decode fast path is off")
        decode = None
    if distributed and (varlen or decode):
        logger.warning("compile off: tensor parallelism")
        return CompilePlan()
    held = torch_held_below_cpu() if device.type == "cpu" and (varlen or decode) else None
    if held:
        logger.warning("compile off: torch is held to %s below this CPU's level "
                       "(ATEN_CPU_CAPABILITY), where inductor's code and ATen's disagree", held)
        return CompilePlan()
    for settings in (s for s in (varlen, decode) if s is not None):
        if device.type == "cuda" and _records_cuda_graphs(settings):
            logger.warning("compile mode %r records CUDA graphs of its own, which replay "
                           "poorly under continuous batching's changing shapes; prefer "
                           "'default' or 'max-autotune-no-cudagraphs'", settings.mode)
    return CompilePlan(varlen, decode)


def _records_cuda_graphs(settings: CompileSettings) -> bool:
    options = settings.options or {}
    if settings.mode is not None:
        options = torch._inductor.list_mode_options(settings.mode)
    return bool(options.get("triton.cudagraphs", False))


class CompiledLayerStep:
    """A layer's `torch_step`, compiled on first use with `settings`; callable as
    `step(layer, hidden, cos, sin, key_cache, value_cache, meta, backend)`.
    Engine thread only."""

    def __init__(self, settings: CompileSettings, path: str) -> None:
        self.path = path
        self.compiled = _compiled_for(settings, path)
        self.failed = False
        self.num_calls = 0
        """Layer calls that ran compiled code."""

    def __call__(self, layer, *args):
        if not self.failed:
            try:
                out = self.compiled(layer, *args)
            except torch._dynamo.exc.TorchDynamoException as error:
                # raised while tracing or compiling: the first graph fails before any
                # of the step ran; a graph after the varlen boundary, once the layer's
                # K/V were stored, and the eager rerun stores the same values again
                logger.warning("compile of the %s path failed (%s); it runs eagerly",
                               self.path, error)
                self.failed = True
            else:
                self.num_calls += 1
                return out
        return layer.torch_step(*args)


def _layer_step(layer, hidden, cos, sin, key_cache, value_cache, meta, backend):
    return layer.torch_step(hidden, cos, sin, key_cache, value_cache, meta, backend)


_compiled: dict[str, Callable] = {}


def _compiled_for(settings: CompileSettings, path: str) -> Callable:
    """One compiled function per distinct settings, shared by every manager using them
    (a new manager then finds its graphs built). Each is compiled from its own copy of
    `_layer_step`'s code: dynamo keeps compiled code per code object, and graphs built
    under other settings must not be handed out."""
    key = f"{path} {settings!r}"     # each path its own graphs and recompile budget
    # (for the frame entered here; see the module's notes on the varlen boundary)
    if key not in _compiled:
        code_copy = types.FunctionType(_layer_step.__code__.replace(), _layer_step.__globals__,
                                       f"layer_step_{len(_compiled)}")
        _compiled[key] = torch.compile(code_copy, **settings.kwargs())
    return _compiled[key]


def compiled_steps(plan: CompilePlan) -> tuple[CompiledLayerStep | None, CompiledLayerStep | None]:
    """(varlen step, decode step) of a plan: None where a path stays eager."""
    if plan.varlen is not None:
        compile_boundary()
    return (None if plan.varlen is None else CompiledLayerStep(plan.varlen, "varlen"),
            None if plan.decode is None else CompiledLayerStep(plan.decode, "decode"))

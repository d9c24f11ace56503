"""Layer executors: the ways a step can run through the decoder layers, chosen per step.

A model's forward offers each step to its executors in order and the first that fits
runs it:

    whole-stack executors   every layer in one native call     (model.executors.stacks)
        FastDecodeStack       decode steps on GGUF blocks        fast_decode.py
        PackedStack           larger steps on bf16 pairs         packed_stack.py
    per-layer executors     one layer in a few direct calls    (model.executors.layers[i])
        FastDecodeLayer       decode steps on GGUF blocks        fast_decode.py
        PackedLayer           larger steps on packed weights     packed_layer.py
    the torch loop          the layer's modules                  always fits, last

Each executor answers `fits(step)` (this step's rows, dtypes, cache layout and
attention metadata are ones it runs) and `run(step)` (the output; called only after
`fits` said yes on the same step). Which executors a model has is chosen once at load
(executor_choice.py), as the last part of the model's construction
(model_parts.py); a runner may pass others for its steps (bench.step's layer loop). A traced step (compile_paths.py's layer_step) and attention
backends other than torch's always take the torch loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class LayerStep:
    """One layer's view of a step."""

    hidden: torch.Tensor          # [T, hidden] the layer's input
    cos: torch.Tensor             # [T, rot_dim] this layer's rotary tables
    sin: torch.Tensor
    kv_cache: Any                 # the runner's PagedKVCache
    meta: Any                     # the step's AttentionMetadata (full group)
    backend: Any                  # the attention backend


@dataclass(frozen=True)
class ModelStep:
    """A whole stack's view of a step."""

    hidden: torch.Tensor          # [T, hidden] the first layer's input
    cos: torch.Tensor             # [T, rot_dim] the full-attention layers' rotary tables
    sin: torch.Tensor
    kv_cache: Any
    meta: Any
    sliding_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    """(cos, sin) of the sliding layers where they differ (Gemma 3's local base)."""


class LayerExecutor(Protocol):
    def fits(self, step: LayerStep) -> bool: ...
    def run(self, step: LayerStep) -> torch.Tensor: ...


class StackExecutor(Protocol):
    def fits(self, step: ModelStep) -> bool: ...
    def run(self, step: ModelStep) -> torch.Tensor: ...


@dataclass(frozen=True)
class Executors:
    """A model's executors besides the torch loop (none: every step runs the modules)."""

    stacks: tuple[StackExecutor, ...] = ()
    layers: tuple[tuple[LayerExecutor, ...], ...] = ()
    """Per layer index, tried in order; empty where the model has none."""
    names: tuple[str, ...] = field(default=(), compare=False)
    """What was chosen, for the load log."""

    def of_layer(self, layer_idx: int) -> tuple[LayerExecutor, ...]:
        return self.layers[layer_idx] if self.layers else ()

    def without_stacks(self) -> "Executors":
        """The same executors but the whole-stack ones (tests and bench.step compare
        the stacks against the layer loop)."""
        return replace(self, stacks=())


def run_stack(executors: Executors, step: ModelStep) -> torch.Tensor | None:
    """The output of the first whole-stack executor that fits, or None."""
    for stack in executors.stacks:
        if stack.fits(step):
            return stack.run(step)
    return None


def run_layer(layer_executors: tuple[LayerExecutor, ...], step: LayerStep) -> torch.Tensor | None:
    """The output of the first of one layer's executors that fits, or None (then the
    layer's modules run)."""
    for executor in layer_executors:
        if executor.fits(step):
            return executor.run(step)
    return None

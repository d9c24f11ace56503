"""Which layer executors (executors.py) one of our models gets, chosen once at load.

For single-process CPU models with the native kernels built, after the linear methods
are settled (method_choice.py: the executors read the packed and block weights):

    per layer   FastDecodeLayer   where its projections and MLP all run on blocks
                PackedLayer       where its attention projections are packed (a
                                  Llama-style layer)
    per model   FastDecodeStack   where every layer has a FastDecodeLayer of one shape
                PackedStack       where every layer holds bf16 pairs of one shape

The stacks come first in the model's order of trial, the per-layer executors next,
the modules last.
"""

from __future__ import annotations

import logging

from torch import nn

from .executors import Executors
from .fast_decode import FastDecodeLayer, FastDecodeStack
from .packed_layer import PackedLayer
from .packed_stack import PackedStack

logger = logging.getLogger(__name__)


def choose_executors(model: nn.Module, kernels) -> Executors:
    """The executors `model`'s layers and stack qualify for on `kernels` (a loaded
    NativeKernels), logged."""
    fast = [FastDecodeLayer(layer, kernels) if FastDecodeLayer.applies(layer) else None
            for layer in model.layers]
    packed = [PackedLayer(layer, kernels) if PackedLayer.applies(layer) else None
              for layer in model.layers]
    every_layer_fast = all(executor is not None for executor in fast)
    stacks = tuple(stack for stack in (
        FastDecodeStack.build(fast, kernels),
        PackedStack.build(list(model.layers), kernels, every_layer_fast)) if stack is not None)
    layers = tuple(tuple(e for e in pair if e is not None) for pair in zip(fast, packed))
    names = tuple(type(stack).__name__ for stack in stacks) + tuple(
        f"{sum(e is not None for e in column)} x {name}"
        for column, name in ((fast, "FastDecodeLayer"), (packed, "PackedLayer")) if any(column))
    logger.info("layer executors: %s, then the modules", ", ".join(names) if names else "none")
    return Executors(stacks, layers if any(layers) else (), names)

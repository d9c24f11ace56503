"""Decode on a GGUF model's own weight blocks: fewer bytes per token, fp32 arithmetic.

A GGUF file stores most weights in blocks: Q4_1 (4-bit codes with a scale and a
minimum per 32 weights), Q8_0 (8-bit codes with a scale), Q5_1 (5-bit codes with a
scale and a minimum, a byte per code in the kernels' form), and the types
block_formats.py converts to those forms without changing a weight (Q4_0, Q5_0, Q4_K,
Q6_K: what a Q4_K_M file holds; Q5_K, of Q5_K_M files). The engine's dense fp32 weights are exactly those
blocks dequantized, so the blocks carry the same numbers in 5 to 10 bits per weight
instead of 32. Decode steps (a few rows) are bound by reading the
weights, so for them BlockLinear multiplies straight from the blocks
(engine/kernels/block_gemm.c; steps of many rows through panels of dequantized
weights, block_panels.c, on AVX2 and AVX-512 builds), accumulating in fp32; larger steps
are bound by arithmetic and multiply the dense weight (fp32, or bf16 in dtype
bf16-weights), packed for oneDNN once at load (packed_linear.py). In dtype
int8-activations the blocks are repacked for the int8 kernels (int8_blocks.py), which
take every step.

model_parts.py builds them for every projection (and the LM head) whose blocks the
GGUF checkpoint holds (gguf_checkpoint.py, which reorders q/k rows as transformers'
GGUF loader does and makes the dense weights from the same blocks).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
import torch.nn.functional as F

from ..kernels.block_layers import gated_mlp, native_weight
from ..kernels.native import FUSED_ACTIVATIONS, GATED_ACTIVATIONS
from .block_formats import Blocks, concat, parse_blocks   # (Blocks, parse_blocks: re-exported)
from ..kernels.block_types import FORMS
from .int8_blocks import Int8Blocks
from .linear_base import LinearMethod
from .packed_linear import pack_weight, packed_gated, packed_linear


MAX_KERNEL_ROWS = 12
"""Up to this many rows per step the row kernels beat the dense fp32 matmuls (the
weights' bytes dominate); past it arithmetic dominates and the dense matmul on the
oneDNN-packed weight (packed_linear.py) wins (docs/cpu-kernels.md, MAX_KERNEL_ROWS).
The limit of builds without AVX2 or AVX-512 (the portable loop), and of Q5_1 weights
on every build (no panels for that form)."""
PANEL_KERNEL_ROWS = 128
"""The same crossover for builds with panels (block_panels.c: AVX2, and AVX-512 with
its own 12 x 32 tiles), which take steps of PANEL_MIN_ROWS rows and more and beat the
packed dense matmul well past the row kernels' limit: on AVX-512 they are ahead or
even at this row count and past it, on AVX2 even from a little past it. On AVX2
prefill chunks of a thousand rows and more run faster dense (docs/cpu-kernels.md,
PANEL_KERNEL_ROWS)."""
BF16_KERNEL_ROWS = 2
"""The same crossover when the dense weights are bf16 (dtype bf16-weights) and go
through the native bf16 GEMM (packed_linear.py): steps of 1-2 rows are bound by
reading weights, where bf16 does not help, and keep the exact fp32 blocks; from 3 rows
the bf16 GEMM wins (docs/cpu-kernels.md, BF16_KERNEL_ROWS)."""


class BlockLinear(LinearMethod):
    """An nn.Linear that also holds its weight as blocks: steps of at most
    `max_rows` fp32 rows use the block kernels, others the dense weight. Without a
    dense weight (`weight` None: blocks_serve_every_step) every fp32 CPU step runs on
    the blocks, and anything else (another dtype or device, a traced step) multiplies
    the blocks dequantized for that call.

    `blocks` may list the parts of a fused weight in row order (q, k, v): parts of one
    kernel form are joined, and where forms differ (a Q4_K_M file's Q4_K q and k
    beside a Q6_K v) `kind` is "mixed" and each part's kernel writes its own columns
    of the output (`parts`; `codes`, `scales`, `minima` are then None). Parts
    repacked for int8 activations (int8_blocks.py) serve every step on their kernels."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 blocks: Blocks | list[Blocks], kernels, bf16_dense: bool = False,
                 pack: bool = False) -> None:
        """`weight`: the dense fp32 weight for large steps, or None. `bf16_dense`: large
        steps multiply a bf16 copy instead (input rounded to bf16, fp32 accumulation
        and output: a multiple of fp32's rate at many rows on AVX-512 BF16,
        docs/benchmarks.md, The machines), and steps past BF16_KERNEL_ROWS take it.
        `pack`: the dense weight is packed for oneDNN (packed_linear.py), no unpacked
        copy kept."""
        parts = joined([blocks] if isinstance(blocks, Blocks) else blocks)
        super().__init__(parts[0].shape[1], sum(part.shape[0] for part in parts))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        single = parts[0] if len(parts) == 1 else None
        self.kind = "mixed" if single is None else single.kind
        for name in ("codes", "scales", "minima"):
            value = None if single is None else getattr(single, name)
            self.register_buffer(name, None if value is None else value.contiguous(),
                                 persistent=False)
        self.parts = parts if single is None else [
            type(single)(self.kind, self.codes, self.scales, self.minima)]
        """The blocks in row order, one entry per kernel form (the buffers, when one)."""
        self.native_weight = native_weight(self.parts)
        """The parts as the native layer and MLP calls read them (kernels.h's
        BlockWeight), or None for more parts than it holds."""
        self.kernels = kernels
        self.max_rows = kernel_rows(kernels)
        if not all(FORMS[part.kind].panels for part in parts):    # no panel tiles
            self.max_rows = min(self.max_rows, MAX_KERNEL_ROWS)
        if weight is None and not bf16_dense:
            if not blocks_serve_every_step(parts, kernels):
                raise ValueError("these blocks need a dense weight for large steps")
            self.max_rows = sys.maxsize
        """Steps of more rows use the dense weight."""
        if bf16_dense:
            weight = (self.dequantized() if weight is None else weight.detach()).to(torch.bfloat16)
            self.max_rows = BF16_KERNEL_ROWS
        self.packed = pack_weight(weight) if pack and weight is not None else None
        self.weight = None if weight is None or self.packed is not None else \
            nn.Parameter(weight, requires_grad=False)

    def describe(self) -> str:
        if self.weight is None and self.packed is None:
            dense = "no dense copy"
        else:
            dtype = (self.packed or self.weight).dtype
            dense = f"dense {str(dtype).removeprefix('torch.')} past {self.max_rows} rows"
        return f"GGUF blocks {'+'.join(part.kind for part in self.parts)}, {dense}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.shape[0] if x.dim() == 2 else x.numel() // in_features
        if (rows > self.max_rows or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.compiler.is_compiling()):     # traced: no ctypes kernel call
            return self._dense(x)
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(rows, in_features).contiguous()
        if self.codes is not None:
            y = self.kernels.gemm(self.kind, flat, self.codes, self.scales, self.minima)
        else:
            y, start = torch.empty(rows, self.out_features, dtype=torch.float32), 0
            for part in self.parts:
                stop = start + part.codes.shape[0]
                self.kernels.gemm(part.kind, flat, part.codes, part.scales, part.minima,
                                  out=y[:, start:stop])
                start = stop
        if self.bias is not None:
            y += self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


    def dequantized(self) -> torch.Tensor:
        """The weight [out_features, in_features] fp32, made from the blocks."""
        return torch.cat([part.dequantize() for part in self.parts])

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None and self.packed is None:      # blocks only: dequantize now
            weight = self.dequantized().to(x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        if self.packed is not None:
            y = packed_linear(x.to(self.packed.dtype), self.packed, x.dtype)
            return y if self.bias is None else y + self.bias
        if self.weight.dtype == x.dtype:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


class FusedBlockMLP:
    """A GatedMLP whose gate/up and down projections are BlockLinears (any kinds)
    without bias, with SiLU or GELU's tanh form (Gemma's): steps of up to the smaller
    of the two projections' `max_rows` run the whole MLP in one native call
    (kernels/block_layers.py: one crossing into C instead of three, no torch ops
    between; Q4_1 weights with SiLU fuse gate, up and the activation into one sweep)."""

    def __init__(self, gate_up: BlockLinear, down: BlockLinear, kernels,
                 activation: str = "silu") -> None:
        self.gate_up, self.down, self.kernels = gate_up, down, kernels
        self.activation = activation
        """A native.GATED_ACTIVATIONS name."""

    @staticmethod
    def applies(gate_up: nn.Module, down: nn.Module, activation: str) -> bool:
        return (isinstance(gate_up, BlockLinear) and isinstance(down, BlockLinear)
                and gate_up.bias is None and down.bias is None
                and gate_up.native_weight is not None and down.native_weight is not None
                and activation in FUSED_ACTIVATIONS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The MLP's output, or None when the step is for the modules. Larger steps
        with packed weights run gate_up, then the activation as one native pass over
        its output (no dtype casts between, in bf16 mode), then down."""
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if x.shape[0] <= min(self.gate_up.max_rows, self.down.max_rows):
            return gated_mlp(self.kernels, x.contiguous(), self.gate_up, self.down,
                             GATED_ACTIVATIONS[self.activation])
        gate_up, down = self.gate_up.packed, self.down.packed
        if gate_up is None or down is None or gate_up.dtype != down.dtype:
            return None
        activated = packed_gated(x.to(gate_up.dtype), gate_up, self.kernels, self.activation)
        return None if activated is None else packed_linear(activated, down, x.dtype)


def blocks_serve_every_step(parts: list[Blocks], kernels) -> bool:
    """Whether the kernels multiply these blocks at any row count (the panels of AVX2
    and AVX-512 builds; Q5_1 has no panels), so no dense copy is needed. At 512 rows
    the panels run even with oneDNN's packed fp32 matmul on AVX-512 (PANEL_KERNEL_ROWS);
    on AVX2, prefill chunks of a thousand rows are slower than dense (also
    PANEL_KERNEL_ROWS), the price of holding 5-10 bits per weight instead of 32. The
    int8 kernels take every step of their forms on any build."""
    return all(isinstance(part, Int8Blocks)
               or (kernels.block_lanes in (8, 16) and FORMS[part.kind].panels) for part in parts)


def kernel_rows(kernels) -> int:
    """Up to how many fp32 rows a step runs on the block kernels of this build: the
    vector builds (AVX2: 8 lanes, AVX-512: 16) have panels for large steps."""
    return PANEL_KERNEL_ROWS if kernels.block_lanes in (8, 16) else MAX_KERNEL_ROWS


def joined(parts: list[Blocks]) -> list[Blocks]:
    """Adjacent parts of one kernel form joined into one."""
    runs: list[list[Blocks]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else concat(run) for run in runs]

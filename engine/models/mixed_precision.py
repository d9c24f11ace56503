"""Reduced-precision weights for CPU serving.

`bf16-weights`: bf16 weights in the compute-bound matmuls and a bf16 KV cache
(attention streams half the bytes; its arithmetic keeps fp32's precision to ~1e-5:
the native kernel's bf16 dot products carry queries and probabilities as two bf16
halves, torch's fallback widens to fp32), fp32 everywhere else (embeddings, the
residual stream, norms, sampling).

Each decoder projection casts its fp32 input to bf16, multiplies against bf16 weights
(bf16 matmuls run at a multiple of fp32's rate on AVX-512 BF16 CPUs: docs/benchmarks.md,
The machines; on AVX2 the native GEMM widens them to fp32 in registers, reading half
fp32's bytes) and returns fp32. On a GGUF model with block kernels, steps small enough for them (decode of up to
BF16_KERNEL_ROWS requests) keep the exact fp32 block path: they are bound by reading
weights, not by arithmetic, so bf16 would not speed them up. Without the native bf16
GEMM (the generic levels, below AVX2 and NEON) the blocks keep every step (method_choice.py). The LM head computes
bf16 logits and then recomputes each row's top RESCORED_CANDIDATES in fp32 (capping
the others below them), so the greedy pick is fp32's whenever fp32's best token is
among bf16's 16 best, and the likely tokens' logits are fp32's. Keeping the residual stream in fp32
keeps most of the accuracy that full bf16 loses (docs/benchmarks.md, Accuracy of the
fast modes). Selected with `load_model(...,
dtype="bf16-weights")`.

`int8-weights`: a bf16 model whose projections and LM head keep int8 weights with one
scale per output channel (symmetric, absmax / 127), multiplied by
`torch.ops.aten._weight_int8pack_mm`. Batch-1 decode reads a quarter of fp32's bytes
and runs faster for it; at large batches that kernel is slower than a bf16 matmul, so
this is a latency mode for a few concurrent streams. Accuracy is that of bf16 or a
little below (docs/benchmarks.md, Accuracy of the fast modes).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .block_weights import BF16_KERNEL_ROWS
from .linear_base import LinearMethod
from .packed_linear import pack_weight, packed_linear

class Bf16WeightLinear(LinearMethod):
    """A linear layer with bf16 weights and fp32 (or any) activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        """weight [out, in], made bf16; with `pack`, packed for oneDNN where it can be
        (packed_linear.py) and no unpacked copy kept."""
        super().__init__(weight.shape[1], weight.shape[0])
        bf16 = weight.detach().to(torch.bfloat16)
        self.packed = pack_weight(bf16) if pack else None
        self.weight = None if self.packed is not None else nn.Parameter(bf16, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)
        """fp32, added to the fp32 product (Qwen2's qkv): no bf16 rounding between."""

    def describe(self) -> str:
        return "bf16 weights" + (", packed" if self.packed is not None else "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = packed_linear(x.to(torch.bfloat16), self.packed, x.dtype)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


RESCORED_CANDIDATES = 16
"""bf16 logits are off by ~0.05 for this model class (0.125 steps past |16|), far less
than the usual gap between a row's 1st and 16th logit, so fp32's argmax is among
bf16's top 16 but in nearly flat rows (docs/cpu-kernels.md, RESCORED_CANDIDATES)."""


class Bf16RescoredHead(LinearMethod):
    """LM head: bf16 logits for the whole vocabulary, then each row's top candidates
    recomputed exactly from the fp32 weight. Steps of up to BF16_KERNEL_ROWS rows
    (block_weights.py) use `exact_head` (a block-kernel head) when there is one."""

    def __init__(self, weight: torch.Tensor, exact_head: nn.Module | None,
                 pack: bool = False) -> None:
        """`pack`: the bf16 copy packed for oneDNN where it can be, no unpacked one kept."""
        super().__init__(weight.shape[1], weight.shape[0])
        self.weight = weight                                   # [vocab, hidden] fp32, shared
        bf16 = weight.detach().to(torch.bfloat16)
        self.packed = pack_weight(bf16) if pack else None
        self.register_buffer("weight_bf16", None if self.packed is not None else bf16,
                             persistent=False)
        self.exact_head = exact_head
        self.exact_rows = 0 if exact_head is None else min(BF16_KERNEL_ROWS, exact_head.max_rows)
        """Steps of up to this many rows take `exact_head`."""
        from ..kernels import default_kernels
        self.kernels = default_kernels()
        """Native finish of the large steps (kernels/head_rescore.c), or None."""

    def describe(self) -> str:
        exact = "" if self.exact_head is None else (
            f"; up to {self.exact_rows} rows GGUF blocks "
            + "+".join(part.kind for part in self.exact_head.parts))
        return f"bf16 logits, top {RESCORED_CANDIDATES} redone in fp32{exact}"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] fp32 -> logits [N, vocab] fp32."""
        if hidden.shape[0] <= self.exact_rows:
            return self.exact_head(hidden)
        approx = (packed_linear(hidden.to(torch.bfloat16), self.packed) if self.packed is not None
                  else F.linear(hidden.to(torch.bfloat16), self.weight_bf16))  # [N, V] bf16
        if self.kernels is not None and hidden.device.type == "cpu" and approx.dim() == 2:
            return self.kernels.rescore_head(approx, hidden.float(), self.weight,
                                             RESCORED_CANDIDATES)
        return self.rescore(approx, hidden)

    def rescore(self, approx: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The same finish in torch ops: approx [N, V] bf16 -> logits [N, V] fp32."""
        candidates = approx.topk(RESCORED_CANDIDATES, dim=-1).indices         # [N, K]
        rows = self.weight[candidates]                                        # [N, K, H]
        exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)     # [N, K]
        # no bf16 value may pass the candidates' least exact one: the best token is then
        # always an exactly recomputed candidate
        logits = torch.minimum(approx.float(), exact.min(dim=-1, keepdim=True).values)
        return logits.scatter_(1, candidates, exact)


KERNEL_K_MULTIPLE = 16
"""`_weight_int8pack_mm` reads the input dimension in chunks of 16 (it crashes on
other sizes); layers whose in_features is not a multiple use the same int8 values
dequantized to bf16 with an ordinary matmul."""


class Int8WeightLinear(LinearMethod):
    """y = x @ (w_int8 * scale).T (+ bias): per-output-channel symmetric int8 weights,
    bf16 activations."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)             # [out]
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.use_kernel = weight.shape[1] % KERNEL_K_MULTIPLE == 0
        self.register_buffer("weight_int8", quantized)                           # [out, in]
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("dequantized", None if self.use_kernel else
                             (quantized.float() * scales.to(torch.bfloat16).float()[:, None])
                             .to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(
            bias.detach().to(torch.bfloat16), requires_grad=False)

    def describe(self) -> str:
        return "int8 weights, per-channel scales" + ("" if self.use_kernel else ", dequantized")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        if self.use_kernel:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        else:
            out = F.linear(flat, self.dequantized)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], -1).to(x.dtype)

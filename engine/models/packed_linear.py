"""Matmuls on weights packed once for oneDNN, for the CPU's compute-bound steps.

On CPU, F.linear multiplies fp32 through MKL and bf16 through oneDNN, bringing the
weight into the kernel's blocked layout on every call. oneDNN's linear on a weight
packed once at load (torch.ops.mkldnn `_reorder_linear_weight` and
`_linear_pointwise`, the pair torch.compile's CPU backend uses) skips that. The gain
is largest at decode steps' row counts and for the LM head, and shrinks for large
prefills, where the arithmetic outweighs the reorder.

Results equal F.linear's up to fp32 summation order (the same products accumulated in
another order, as with any other BLAS). A packed weight is an opaque oneDNN tensor:
only `packed_linear` reads it, it stays on the CPU, and it is kept as a plain
attribute, not a parameter or buffer, so module-wide `.to()` / state_dict never meet it.

method_choice.py packs a model's dense weights as it builds them, for single-process
CPU models, in the dtype their mode gives them. Packed is as fast as F.linear
at one row and faster from a few rows on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from .linear_base import LinearMethod

PACKING_BATCH_HINT = 64
"""Rows oneDNN tunes the packed layout for; any row count may use it."""

_available: dict[torch.dtype, bool] = {}


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has the ops for `dtype` weights on this CPU and they agree
    with F.linear (checked once per dtype). oneDNN packs bf16 weights only on CPUs
    with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere bf16 weights stay unpacked
    and F.linear multiplies them."""
    if dtype not in _available:
        try:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(48, 64, generator=generator).to(dtype)
            x = torch.randn(5, 64, generator=generator).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            _available[dtype] = bool(torch.allclose(y.float(), F.linear(x, weight).float(),
                                                    rtol=tolerance, atol=tolerance))
        except (AttributeError, RuntimeError, NotImplementedError):
            _available[dtype] = False
    return _available[dtype]


NATIVE_BF16_MAX_ROWS = 128
"""Up to this many rows a bf16 product runs on the native bf16 GEMM (bf16_gemm.c),
past it on oneDNN. The native GEMM leads at decode steps' row counts; oneDNN is ahead
on the LM head at a few hundred rows and on large prefills (docs/cpu-kernels.md,
NATIVE_BF16_MAX_ROWS)."""


@dataclass(eq=False)
class PackedWeight:
    """A weight [out, in] packed once at load. `onednn`: oneDNN's blocked layout
    (opaque: only oneDNN's linear reads it), or None where oneDNN cannot pack bf16
    weights on this CPU (AVX2 without AVX-512) and the native GEMM takes every step.
    `pairs`: for bf16 weights with an even `in`, where the native kernels have a bf16
    GEMM, the same weight as [ceil(out / 16), in / 2, 16, 2] (bf16_gemm.c's layout),
    else None. One of the two is always there."""

    onednn: torch.Tensor | None
    pairs: torch.Tensor | None
    out_features: int
    kernels: object = None
    gated_inter: int = 0
    """> 0: `pairs` hold a gated MLP's gate/up as alternating 16-row blocks (gate_pairs)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.pairs.dtype if self.onednn is None else self.onednn.dtype

    def native_rows(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs on the native bf16 GEMM (eagerly):
        up to NATIVE_BF16_MAX_ROWS, or always where oneDNN holds no copy."""
        return (self.pairs is not None and (rows <= NATIVE_BF16_MAX_ROWS or self.onednn is None)
                and not torch.compiler.is_compiling())


def bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16, K even -> [ceil(N / 16), K / 2, 16, 2]: element (j, p, c, i)
    is weight[16 j + c, 2 p + i], zero past N. Worked: N = 20, K = 4 gives [2, 2, 16, 2];
    (1, 1, 3, 0) is weight[19, 2]; (1, 1, 4, 0) is padding."""
    out_features, in_features = weight.shape
    padded = -out_features % 16
    if padded:
        weight = torch.cat([weight, weight.new_zeros(padded, in_features)])
    vectors = weight.shape[0] // 16
    return weight.view(vectors, 16, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """weight [out, in], CPU fp32 or bf16 -> its packed forms, or None where packing
    does not apply (another device or dtype, or a torch without the ops)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    weight = weight.detach().contiguous()
    kernels, pairs = None, None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        from ..kernels import default_kernels

        kernels = default_kernels()
        if kernels is not None and kernels.has_bf16_gemm:
            pairs = bf16_pairs(weight)
    onednn = (torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
              if packing_available(weight.dtype) else None)
    if onednn is None and pairs is None:
        return None
    return PackedWeight(onednn, pairs, weight.shape[0], kernels if pairs is not None else None)


def gate_pairs(packed: PackedWeight) -> None:
    """Reorder a gated MLP's packed gate/up (gate rows first, then up, I each, I a
    multiple of 16) into alternating 16-row blocks, gate 0, up 0, gate 1, ..., so one
    panel of the native GEMM holds a (gate, up) pair (packed_gated). Plain products
    still come out gate columns first."""
    if packed.pairs is None or packed.gated_inter or packed.out_features % 32:
        return
    half = packed.pairs.shape[0] // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    packed.pairs = packed.pairs.index_select(0, order).contiguous()
    packed.gated_inter = packed.out_features // 2


def packed_gated(x: torch.Tensor, gate_up: PackedWeight, kernels,
                 activation: str = "silu") -> torch.Tensor | None:
    """act(gate) * up of a gated MLP for x [rows, in] bf16 -> [rows, I] bf16: in one
    native pass from the gate/up GEMM's fp32 sums where the weight is paired
    (gate_pairs), else for SiLU the bf16 product, then gated_activation (`kernels`,
    or the weight's own); None for another activation there."""
    if gate_up.gated_inter and gate_up.native_rows(x.shape[0]):
        return gate_up.kernels.bf16_gemm(x, gate_up.pairs, gate_up.out_features, torch.bfloat16,
                                         gate_up.gated_inter, activation=activation)
    if activation != "silu":
        return None
    return (kernels or gate_up.kernels).gated_activation(packed_linear(x, gate_up))


@torch.library.custom_op("kvserve::packed_matmul", mutates_args=())
def packed_matmul_op(flat: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The packed product as an opaque op for torch.compile: inductor's own lowering of
    `_linear_pointwise` rejects weights packed outside its graph, so traced layer
    steps (compile_paths.py) call it through this op instead."""
    return torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")


@packed_matmul_op.register_fake
def _(flat: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], out_features)


@torch.library.custom_op("kvserve::native_bf16_matmul", mutates_args=())
def native_bf16_matmul_op(flat: torch.Tensor, pairs: torch.Tensor, out_features: int,
                          gated_inter: int) -> torch.Tensor:
    """The native bf16 GEMM as an opaque op for traced layer steps, where oneDNN holds
    no copy of the weight (dynamo cannot trace the ctypes call itself)."""
    from ..kernels import default_kernels

    return default_kernels().bf16_gemm(flat, pairs, out_features, torch.bfloat16, gated_inter)


@native_bf16_matmul_op.register_fake
def _(flat: torch.Tensor, pairs: torch.Tensor, out_features: int,
      gated_inter: int) -> torch.Tensor:
    return flat.new_empty(flat.shape[0], out_features, dtype=torch.bfloat16)


def packed_linear(x: torch.Tensor, packed: PackedWeight,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] in the packed weight's dtype -> x @ weight.T [..., out], in the
    weight's dtype or `out_dtype` (fp32 from a bf16 weight: the fp32 accumulators as
    they are, where the native GEMM serves; rounded through bf16 where oneDNN does)."""
    flat = x.reshape(-1, x.shape[-1])
    compiling = torch.compiler.is_compiling()
    if packed.native_rows(flat.shape[0]):
        y = packed.kernels.bf16_gemm(flat, packed.pairs, packed.out_features,
                                     out_dtype or packed.dtype, packed.gated_inter)
    else:
        flat = flat.contiguous()
        if packed.onednn is None:         # traced: the native GEMM as an opaque op
            y = native_bf16_matmul_op(flat, packed.pairs, packed.out_features,
                                      packed.gated_inter)
        elif compiling:
            y = packed_matmul_op(flat, packed.onednn, packed.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, packed.onednn, None, "none", [], "")
        if out_dtype is not None and y.dtype != out_dtype:
            y = y.to(out_dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class PackedLinear(LinearMethod):
    """An nn.Linear whose weight lives packed (see above); y = x @ W^T + b."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.packed = packed
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def describe(self) -> str:
        pairs = " + bf16 pairs" if self.packed.pairs is not None else ""
        return f"dense {_dtype_name(self.packed.dtype)}, packed{pairs}"

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedLinear | None":
        """weight [out, in] packed, or None where packing does not apply."""
        packed = pack_weight(weight)
        if packed is None or (bias is not None and bias.dtype != weight.dtype):
            return None
        return cls(packed, bias, weight.shape[1], weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x.to(self.packed.dtype), self.packed)
        return y if self.bias is None else y + self.bias


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""The load plan: what load_model does with a model, decided once, before any weight is
read, by one pure function of what is known then.

    plan_load(dtype, source, device, tp_size, block_kernels, kernels) -> LoadPlan

`source` says what the weights are (a GGUF file, an HF directory, a module) and whether
one of our families has code for them; `kernels` are the facts of the native CPU
kernels built for this CPU's ISA level (CpuKernels: the level, the block lanes, the
int8 loop, how the native bf16 GEMM multiplies), None where none serve. The plan names
the compute dtype, whether a GGUF's blocks are multiplied natively and in which
form, how projections and the LM head are held, the KV cache's dtype and the ISA
level; or plan_load raises LoadRefused with the reason and what to use instead.
load_model carries the plan out and logs it as one table (LoadPlan.table).

The dtype names are declared here once (DTYPES); the server's settings and load_model's
checks read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class DtypeMode:
    """One `dtype` a user may ask for. `compute`: the activations' dtype (None: "auto",
    chosen per device). `own_family_only`: needs one of our model families (weights
    replaced per projection); `gguf_cpu_only`: needs a GGUF's blocks on the native
    CPU kernels. `kv_cache`: its default KV cache dtype (None: the compute dtype on
    accelerators, fp32 on CPU). `weights`: the weights its projections take
    (method_choice.py): "bf16" (Bf16WeightLinear), "int8" (Int8WeightLinear) or None
    (the checkpoint's, in the compute dtype, or a GGUF's blocks)."""

    name: str
    aliases: tuple[str, ...]
    compute: torch.dtype | None
    own_family_only: bool = False
    gguf_cpu_only: bool = False
    kv_cache: torch.dtype | None = None
    weights: Literal["bf16", "int8"] | None = None


DTYPES = (
    DtypeMode("auto", (), None),
    DtypeMode("float32", ("fp32",), torch.float32),
    DtypeMode("bfloat16", ("bf16",), torch.bfloat16),
    DtypeMode("float16", ("fp16", "half"), torch.float16),
    DtypeMode("bf16-weights", ("bfloat16-weights",), torch.float32, own_family_only=True,
              kv_cache=torch.bfloat16, weights="bf16"),
    DtypeMode("int8-weights", (), torch.bfloat16, own_family_only=True, weights="int8"),
    DtypeMode("int8-activations", (), torch.float32, own_family_only=True,
              gguf_cpu_only=True),
)
DTYPE_NAMES = tuple(mode.name for mode in DTYPES)
"""The names `dtype` accepts (each mode's aliases too)."""
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LoadRefused(ValueError):
    """This dtype cannot serve this model here: the message says why and what to use."""


def dtype_mode(name: str | torch.dtype | None) -> DtypeMode:
    """The DtypeMode of a dtype name, alias or torch dtype (None: float32)."""
    if name is None:
        name = "float32"
    if isinstance(name, torch.dtype):
        found = [mode for mode in DTYPES[1:4] if mode.compute == name]
    else:
        found = [mode for mode in DTYPES if name == mode.name or name in mode.aliases]
    if not found:
        raise LoadRefused(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return found[0]


@dataclass(frozen=True)
class CpuKernels:
    """What the plan reads of the native CPU kernels (kernels/native.py's
    NativeKernels): the ISA level they are built for, their block lanes (16, 8 or 1),
    the int8-activation loop and how the native bf16 GEMM multiplies
    (native.BF16_GEMMS: "avx512_bf16", "widening" on AVX2, or "none")."""

    isa: str
    block_lanes: int
    int8_path: str
    bf16_gemm: str

    @property
    def has_bf16_gemm(self) -> bool:
        return self.bf16_gemm != "none"

    @classmethod
    def of(cls, kernels) -> "CpuKernels":
        return cls(kernels.isa, kernels.block_lanes, kernels.int8_path, kernels.bf16_gemm_kind)


@dataclass(frozen=True)
class ModelSource:
    """What the weights are: `kind` a GGUF file, an HF directory or an nn.Module;
    `own_family` whether one of our decoder implementations has code for them."""

    kind: Literal["gguf", "hf", "module"]
    own_family: bool
    model_type: str = "llama"


@dataclass(frozen=True)
class LoadPlan:
    """What load_model does (see the module docstring)."""

    dtype: DtypeMode
    compute: torch.dtype
    device: str
    tp_size: int
    block_kernels: bool
    """A GGUF's blocks multiplied by the native kernels (BlockLinear)."""
    int8_activations: bool
    """The blocks repacked for int8 activations (models/int8_blocks.py)."""
    native_bf16: bool
    """bf16 products run on the native bf16 GEMM (AVX512-BF16, or widened to fp32 on
    AVX2): bf16-weights then gives a GGUF's large steps bf16 weights; without it the
    blocks keep every step."""
    dense_table: bool
    """The GGUF's embedding table also kept dense in fp32, for bf16-weights' LM head
    (its bf16 logits' top candidates redone in fp32)."""
    projections: str
    head: str
    kv_cache: torch.dtype | None
    """None: the model's own default (the compute dtype; fp32 on CPU)."""
    isa: str | None
    """The kernels' ISA level, None where no native kernel runs."""
    auto_choice: str | None = None
    """What dtype "auto" chose on the CPU and why (None: a dtype was named, or not CPU)."""

    def rows(self) -> list[tuple[str, str]]:
        kv = "model default" if self.kv_cache is None else _name(self.kv_cache)
        chosen = f"; auto: {self.auto_choice}" if self.auto_choice else ""
        return [("dtype", f"{self.dtype.name} (activations {_name(self.compute)}{chosen})"),
                ("device", f"{self.device}, tp_size {self.tp_size}"),
                ("kernels", f"native, {self.isa} level" if self.isa else "torch ops"),
                ("projections", self.projections), ("lm_head", self.head),
                ("kv cache", kv)]

    def table(self) -> str:
        return "\n".join(f"  {key:<12} {value}" for key, value in self.rows())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_load(dtype: str | torch.dtype | None, source: ModelSource, device: str,
              tp_size: int = 1, block_kernels: bool = True, kernels: CpuKernels | None = None,
              kv_cache_dtype: str = "auto", auto_compute: torch.dtype = torch.float32
              ) -> LoadPlan:
    """The plan for loading `source` in `dtype` on `device` (a device type: "cpu",
    "cuda") over `tp_size` processes; `block_kernels` False keeps a GGUF's weights
    dense; `kernels` the CPU kernels' facts (None: none built, or not on CPU);
    `auto_compute` what dtype "auto" computes in on this device (loading.auto_dtype).
    Raises LoadRefused where the combination cannot serve."""
    mode = dtype_mode(dtype)
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise LoadRefused(f"kv_cache_dtype must be 'auto', 'float32' or 'bfloat16', "
                          f"got {kv_cache_dtype!r}")
    auto_choice = None
    if mode.name == "auto" and device == "cpu":
        mode, auto_choice = _auto_on_cpu(source, tp_size, block_kernels, kernels)
    _check_family(mode, source, tp_size)
    compute = mode.compute or auto_compute
    on_blocks = (source.kind == "gguf" and source.own_family and device == "cpu"
                 and tp_size == 1 and compute == torch.float32 and block_kernels
                 and kernels is not None)
    if mode.gguf_cpu_only:
        _check_int8_activations(on_blocks, kernels)
    if mode.weights == "bf16" and device == "cpu" and not on_blocks:
        _check_bf16_products(kernels)
    projections, head = _methods(mode, compute, source, on_blocks, kernels)
    kv = KV_CACHE_DTYPES[kv_cache_dtype] if kv_cache_dtype != "auto" else mode.kv_cache
    native_bf16 = kernels is not None and device == "cpu" and kernels.has_bf16_gemm
    dense_table = on_blocks and mode.weights == "bf16" and native_bf16
    return LoadPlan(mode, compute, device, tp_size, on_blocks, mode.gguf_cpu_only, native_bf16,
                    dense_table, projections, head, kv,
                    kernels.isa if kernels is not None and device == "cpu" else None,
                    auto_choice)


def _auto_on_cpu(source: ModelSource, tp_size: int, block_kernels: bool,
                 kernels: CpuKernels | None) -> tuple[DtypeMode, str]:
    """The mode "auto" serves on the CPU, and why: a GGUF file of our families with
    int8 activations on its blocks, as llama.cpp multiplies them, wherever an int8
    vector loop is built; float32, the exact mode, everywhere else. Never a refusal.
    How faithful and how fast each is: docs/benchmarks.md ("Accuracy of the fast
    modes", "Online serving")."""
    float32, int8 = dtype_mode("float32"), dtype_mode("int8-activations")
    if source.kind != "gguf":
        return float32, "float32 for a model that is not a GGUF file"
    why_not = ("its model_type runs on transformers' code" if not source.own_family
               else "tensor parallelism multiplies dense weights" if tp_size > 1
               else "the block kernels are turned off" if not block_kernels
               else "no native kernels were built (no C compiler)" if kernels is None
               else f"the {kernels.isa} level has no int8 vector loop"
               if kernels.int8_path == "portable" else None)
    if why_not:
        return float32, f"float32: int8 activations would need the GGUF's blocks, but {why_not}"
    return int8, f"int8 activations on the GGUF's blocks ({kernels.int8_path} loop)"


def _check_family(mode: DtypeMode, source: ModelSource, tp_size: int) -> None:
    if source.own_family:
        return
    if mode.own_family_only:
        raise LoadRefused(f"dtype {mode.name} needs one of our model families; model_type "
                          f"{source.model_type!r} runs on transformers' modeling code "
                          f"(use float32, bfloat16 or float16)")
    if tp_size > 1:
        raise LoadRefused(f"model_type {source.model_type!r} runs on transformers' modeling "
                          f"code, which is not sharded: tensor parallelism needs one of "
                          f"our families")


def _check_int8_activations(on_blocks: bool, kernels: CpuKernels | None) -> None:
    if not on_blocks:
        raise LoadRefused("dtype int8-activations multiplies a GGUF file's blocks with the "
                          "native CPU kernels: it needs a .gguf model, device cpu, tp_size 1 "
                          "and a C compiler (use float32 otherwise)")
    if kernels.int8_path == "portable":
        raise LoadRefused(f"dtype int8-activations needs int8 vector instructions (AVX2 or "
                          f"better); the kernels here are built for the {kernels.isa} level, "
                          f"whose portable int8 loop is many times slower than float32: use "
                          f"dtype float32")


def _check_bf16_products(kernels: CpuKernels | None) -> None:
    """bf16-weights on dense weights needs the native bf16 GEMM (AVX512-BF16, or the
    widening tile on AVX2): without it torch's bf16 products widen in loops at about
    half float32's rate (docs/benchmarks.md, "On an AVX2 CPU"). Without native kernels
    at all nothing is known of the CPU, and torch's own paths serve."""
    if kernels is not None and not kernels.has_bf16_gemm:
        raise LoadRefused(f"dtype bf16-weights multiplies dense bf16 weights with the native "
                          f"bf16 GEMM, which needs AVX2 or NEON; on this CPU's {kernels.isa} "
                          f"level torch's bf16 products run at about half float32's rate: "
                          f"use dtype float32 (a GGUF file's blocks serve bf16-weights here)")


def _methods(mode: DtypeMode, compute: torch.dtype, source: ModelSource, on_blocks: bool,
             kernels: CpuKernels | None) -> tuple[str, str]:
    """How projections and the LM head hold their weights, in the load log's words."""
    from ..models.block_weights import BF16_KERNEL_ROWS
    from ..models.mixed_precision import RESCORED_CANDIDATES

    rescored = f"bf16 logits, top {RESCORED_CANDIDATES} redone in fp32"
    if on_blocks:
        if mode.gguf_cpu_only:
            blocks = f"GGUF blocks in int8 forms, int8 activations ({kernels.int8_path} loop)"
            return blocks, blocks
        if mode.weights == "bf16" and kernels.has_bf16_gemm:
            small = f"GGUF blocks up to {BF16_KERNEL_ROWS} rows"
            gemm = "widened to fp32" if kernels.bf16_gemm == "widening" else "AVX512-BF16"
            return (f"{small}, bf16 weights past them (native bf16 GEMM, {gemm})",
                    f"{small}; {rescored}")
        blocks = f"GGUF blocks, fp32 activations ({kernels.block_lanes} lanes)"
        if mode.weights == "bf16":          # no native bf16 GEMM: torch's is slower
            blocks += "; no bf16 copy: no native bf16 GEMM at this level"
        return blocks, blocks
    made = ", dequantized from the GGUF's blocks" if source.kind == "gguf" else ""
    if mode.weights == "bf16":
        return f"bf16 weights{made}, fp32 activations", rescored
    if mode.weights == "int8":
        made = ", requantized from the GGUF's blocks" if source.kind == "gguf" else ""
        return f"int8 weights per channel{made}, bf16 activations", "int8 weights per channel"
    return f"dense {_name(compute)}{made}", f"dense {_name(compute)}"

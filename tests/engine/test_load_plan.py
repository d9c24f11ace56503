"""The load plan (engine/loading/load_plan.py) over the whole matrix: dtype x source x family x
device x the CPU kernels' ISA level, each cell a plan or a refusal with its reason."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.loading.load_plan import (DTYPE_NAMES, CpuKernels, LoadRefused, ModelSource, dtype_mode,
                              plan_load)

LEVELS = {
    "avx512-bf16": CpuKernels("avx512", 16, "avx512_vnni", "avx512_bf16"),
    "avx2": CpuKernels("avx2", 8, "avx2", "widening"),
    "generic": CpuKernels("generic", 1, "portable", "none"),
    "none": None,                                 # no C compiler: no native kernels
}
SOURCES = {"gguf": ModelSource("gguf", True), "hf": ModelSource("hf", True),
           "gguf-other": ModelSource("gguf", False, "phi3"),
           "hf-other": ModelSource("hf", False, "phi3")}


def auto_on_cpu(source: str, level: str) -> str:
    """What "auto" must serve on the CPU: int8 activations for a GGUF of our families
    where an int8 vector loop is built, float32 everywhere else."""
    kernels = LEVELS[level]
    fast = source == "gguf" and kernels is not None and kernels.int8_path != "portable"
    return "int8-activations" if fast else "float32"


def expected(dtype: str, source: str, device: str, level: str):
    """What the plan must be: a refusal's words, or (compute, on blocks, int8, the
    projections' method's start, the KV cache)."""
    own = not source.endswith("other")
    kernels = LEVELS[level] if device == "cpu" else None
    mode = dtype_mode(auto_on_cpu(source, level) if dtype == "auto" and device == "cpu"
                      else dtype)
    dtype = mode.name
    if mode.own_family_only and not own:
        return "needs one of our model families"
    compute = mode.compute or (torch.float32 if device == "cpu" else torch.bfloat16)
    blocks = (source == "gguf" and device == "cpu" and kernels is not None
              and compute == torch.float32)
    if dtype == "int8-activations":
        if not blocks:
            return "it needs a .gguf model, device cpu"
        if kernels.int8_path == "portable":
            return "portable int8 loop is many times slower"
        return compute, True, True, "GGUF blocks in int8 forms", None
    if dtype == "bf16-weights" and not blocks and kernels is not None \
            and not kernels.has_bf16_gemm:
        return "about half float32's rate: use dtype float32"
    if blocks and dtype == "bf16-weights":
        method = ("GGUF blocks up to 2 rows, bf16 weights" if kernels.has_bf16_gemm
                  else "GGUF blocks, fp32 activations (1 lanes); no bf16 copy")
        return compute, True, False, method, torch.bfloat16
    if blocks:
        return compute, True, False, f"GGUF blocks, fp32 activations ({kernels.block_lanes}", None
    method = {"bf16-weights": "bf16 weights", "int8-weights": "int8 weights per channel"}.get(
        dtype, f"dense {str(compute).removeprefix('torch.')}")
    return compute, False, False, method, mode.kv_cache


@pytest.mark.parametrize("dtype, source, device, level", [
    cell for cell in itertools.product(DTYPE_NAMES, SOURCES, ("cpu", "cuda"), LEVELS)
    if cell[2] == "cpu" or cell[3] == "none"])
def test_every_cell_of_the_matrix(dtype, source, device, level):
    kernels = LEVELS[level] if device == "cpu" else None
    want = expected(dtype, source, device, level)
    if isinstance(want, str):
        with pytest.raises(LoadRefused, match=want):
            plan_load(dtype, SOURCES[source], device, 1, True, kernels,
                      auto_compute=torch.bfloat16 if device == "cuda" else torch.float32)
        return
    plan = plan_load(dtype, SOURCES[source], device, 1, True, kernels,
                     auto_compute=torch.bfloat16 if device == "cuda" else torch.float32)
    compute, on_blocks, int8, method, kv = want
    assert (plan.compute, plan.block_kernels, plan.int8_activations) == (compute, on_blocks, int8)
    assert plan.projections.startswith(method), plan.projections
    assert plan.kv_cache == kv
    assert plan.native_bf16 == (kernels is not None and kernels.has_bf16_gemm)
    assert plan.dense_table == (on_blocks and dtype == "bf16-weights"
                                and kernels.has_bf16_gemm)
    assert plan.isa == (kernels.isa if kernels is not None else None)
    served = auto_on_cpu(source, level) if dtype == "auto" and device == "cpu" else dtype
    assert plan.dtype.name == served and served in plan.table()
    assert (plan.auto_choice is not None) == (dtype == "auto" and device == "cpu")


def test_auto_falls_back_to_float32_and_says_why():
    gguf, avx2 = SOURCES["gguf"], LEVELS["avx2"]
    cases = {"the block kernels are turned off": dict(block_kernels=False, kernels=avx2),
             "tensor parallelism": dict(tp_size=2, kernels=avx2),
             "no native kernels were built": dict(kernels=None),
             "the generic level has no int8 vector loop": dict(kernels=LEVELS["generic"])}
    for reason, options in cases.items():
        plan = plan_load("auto", gguf, "cpu", **options)
        assert plan.dtype.name == "float32" and not plan.int8_activations
        assert reason in plan.table(), plan.table()
    plan = plan_load("auto", SOURCES["gguf-other"], "cpu", kernels=avx2)
    assert plan.dtype.name == "float32" and "transformers' code" in plan.auto_choice
    plan = plan_load("auto", gguf, "cpu", kernels=avx2)
    assert plan.int8_activations and "avx2 loop" in plan.table()
    assert plan_load("auto", gguf, "cuda").dtype.name == "auto"


def test_a_ggufs_blocks_are_named_where_they_are_made_dense_or_requantized():
    gguf, avx2 = SOURCES["gguf"], LEVELS["avx2"]
    assert "requantized from the GGUF's blocks" in plan_load("int8-weights", gguf, "cpu",
                                                             kernels=avx2).projections
    assert "dequantized from the GGUF's blocks" in plan_load("float32", gguf, "cpu",
                                                             block_kernels=False,
                                                             kernels=avx2).projections
    assert not plan_load("float32", gguf, "cpu", tp_size=2, kernels=avx2).block_kernels
    assert "(native bf16 GEMM, widened to fp32)" in plan_load("bf16-weights", gguf, "cpu",
                                                              kernels=avx2).projections


def test_tensor_parallelism_needs_one_of_our_families():
    with pytest.raises(LoadRefused, match="'phi3' runs on transformers' modeling code"):
        plan_load("float32", SOURCES["hf-other"], "cpu", tp_size=2, kernels=LEVELS["avx2"])


def test_names_aliases_and_the_kv_cache_setting():
    assert dtype_mode("bf16").name == "bfloat16" and dtype_mode(torch.float16).name == "float16"
    assert dtype_mode("bfloat16-weights").name == "bf16-weights"
    with pytest.raises(LoadRefused, match="dtype must be one of auto, float32"):
        dtype_mode("float64")
    plan = plan_load("bf16-weights", SOURCES["hf"], "cpu", kernels=LEVELS["avx512-bf16"],
                     kv_cache_dtype="float32")
    assert plan.kv_cache == torch.float32
    with pytest.raises(LoadRefused, match="kv_cache_dtype"):
        plan_load("float32", SOURCES["hf"], "cpu", kv_cache_dtype="int4")


def test_the_server_offers_exactly_these_dtypes():
    from typing import get_args

    from server.settings import ServerSettings

    assert get_args(ServerSettings.model_fields["dtype"].annotation) == DTYPE_NAMES

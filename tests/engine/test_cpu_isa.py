"""The kernels' ISA levels (engine/kernels/isa.py): which level a CPU runs, the cap,
and that a capped build holds no instruction above its level."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest

from engine.kernels import load_native_kernels
from engine.kernels.isa import (ARM_LEVELS, X86_LEVELS, UnknownIsaError, choose_level,
                                cpu_features)

ZEN3 = ("flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe "
        "popcnt aes\n")
ALDER_LAKE = ZEN3.replace("aes", "aes avx_vnni")
ZEN4 = ZEN3.replace("aes", "aes avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
                    "avx512_bf16")
GRAVITON3 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp i8mm\n"


@pytest.mark.parametrize("cpuinfo, cap, want", [
    (ZEN3, None, "avx2"), (ZEN3, "avx512", "avx2"), (ZEN3, "generic", "generic"),
    (ALDER_LAKE, None, "avx_vnni"), (ALDER_LAKE, "avx2", "avx2"),
    (ZEN4, None, "avx512"), (ZEN4, "avx_vnni", "avx2"), (ZEN4, "native", "avx512"),
    ("flags\t\t: fpu sse sse2\n", None, "generic"),
])
def test_the_level_is_the_cpus_best_under_the_cap(cpuinfo, cap, want):
    assert choose_level(cpu_features(cpuinfo), cap, X86_LEVELS).name == want


def test_arm_levels():
    features = cpu_features(GRAVITON3)
    assert choose_level(features, None, ARM_LEVELS).name == "dotprod"
    assert choose_level(features, "neon", ARM_LEVELS).name == "neon"
    assert "-DKVSERVE_PLAIN_C" in choose_level(features, "generic", ARM_LEVELS).flags


def test_avx512s_optional_extensions_follow_the_cpu():
    flags = choose_level(cpu_features(ZEN4), None, X86_LEVELS).compiler_flags(
        cpu_features(ZEN4))
    assert "-mavx512vnni" in flags and "-mavx512bf16" in flags and "-mamx-tile" not in flags


def test_an_unknown_level_is_refused_with_the_choices():
    with pytest.raises(UnknownIsaError, match="avx2"):
        choose_level(cpu_features(ZEN3), "sse9", X86_LEVELS)


# Register names no instruction of the level can touch: AVX2 code has no zmm or mask
# registers, baseline x86-64 code no ymm either.
FORBIDDEN = {"generic": ("%ymm", "%zmm", "%k1"), "avx2": ("%zmm", "%k1", "{%k")}


@pytest.mark.parametrize("level", ["generic", "avx2"])
def test_a_capped_library_holds_no_instruction_above_its_level(level, monkeypatch):
    objdump = shutil.which("objdump")
    if platform.machine() != "x86_64" or objdump is None:
        pytest.skip("reads x86-64 code with objdump")
    monkeypatch.setenv("KVSERVE_CPU_ISA", level)
    kernels = load_native_kernels()
    assert kernels is not None and kernels.isa == level
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", kernels.path],
                          capture_output=True, text=True, check=True).stdout
    assert "vfmadd" in code if level == "avx2" else "vfmadd" not in code
    for register in FORBIDDEN[level]:
        assert register not in code, f"{level} build uses {register}"
    assert kernels.block_lanes == (8 if level == "avx2" else 1)
    assert kernels.int8_path == ("avx2" if level == "avx2" else "portable")
    assert kernels.bf16_gemm_kind == ("widening" if level == "avx2" else "none")

"""The instruction-set levels the native kernels are built for, and which one runs.

The kernels are C with one code path per ISA family, chosen by the compiler's
predefined macros (__AVX2__, __AVX512VNNI__, __ARM_FEATURE_DOTPROD ...). Each level
below is one build of the whole library with its own target flags, so a level's
library holds no instruction above that level: the same scheme as a CPU backend built
once per microarchitecture and picked at start. The level that runs is the highest one
this CPU supports, capped by KVSERVE_CPU_ISA (or the server's --cpu-isa): with
KVSERVE_CPU_ISA=avx2 an AVX-512 machine runs exactly the library an AVX2-only machine
runs, so that machine's speed and numerics can be measured and tested here.

Pure Python (no torch): build.py builds the chosen level, the server names it at start.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IsaLevel:
    """One build target: `name` as KVSERVE_CPU_ISA spells it; `flags` the compiler's
    target flags; `requires` the /proc/cpuinfo feature names a CPU needs to run it;
    `optional` (flag, feature) pairs added when the CPU has the feature (AVX-512's
    VNNI, BF16 and AMX come and go between AVX-512 CPUs); `torch_capability` the
    ATEN_CPU_CAPABILITY that keeps torch's own kernels at or below the level."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str]
    optional: tuple[tuple[str, str], ...] = ()
    torch_capability: str = "default"

    def compiler_flags(self, features: frozenset[str]) -> tuple[str, ...]:
        return self.flags + tuple(flag for flag, feature in self.optional
                                  if feature in features)


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
X86_LEVELS = (
    IsaLevel("generic", ("-march=x86-64", "-mtune=generic"), frozenset()),
    IsaLevel("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3, torch_capability="avx2"),
    IsaLevel("avx_vnni", ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"),
             _V3 | {"avx_vnni"}, torch_capability="avx2"),
    IsaLevel("avx512", ("-march=x86-64-v4", "-mtune=generic"),
             _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
             optional=(("-mavx512vnni", "avx512_vnni"), ("-mavx512bf16", "avx512_bf16"),
                       ("-mavxvnni", "avx_vnni"), ("-mamx-tile", "amx_tile"),
                       ("-mamx-bf16", "amx_bf16")),
             torch_capability="avx512"),
)
"""x86-64 levels, lowest first."""

ARM_LEVELS = (
    IsaLevel("generic", ("-march=armv8-a", "-DKVSERVE_PLAIN_C"), frozenset()),
    IsaLevel("neon", ("-march=armv8-a",), frozenset({"asimd"})),
    IsaLevel("dotprod", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"})),
)
"""aarch64 levels, lowest first: NEON is part of every aarch64 CPU, so the generic
level is told (KVSERVE_PLAIN_C) to keep to its plain C paths."""


class UnknownIsaError(ValueError):
    """KVSERVE_CPU_ISA names no level of this machine's architecture."""


def machine_levels(machine: str | None = None) -> tuple[IsaLevel, ...]:
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return X86_LEVELS
    if machine in ("aarch64", "arm64"):
        return ARM_LEVELS
    return (IsaLevel("generic", (), frozenset()),)


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature names: /proc/cpuinfo's `flags` (x86) or `Features` (ARM), or
    those of the `cpuinfo` text given."""
    return _features_of(cpuinfo if cpuinfo is not None else _this_cpuinfo())


@functools.lru_cache(maxsize=1)
def _this_cpuinfo() -> str:
    """/proc/cpuinfo, read once per process (every kernel load asks for it)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _features_of(cpuinfo: str) -> frozenset[str]:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose_level(features: frozenset[str], cap: str | None = None,
                 levels: tuple[IsaLevel, ...] | None = None) -> IsaLevel:
    """The highest level the CPU runs, at or below `cap` (a level's name; None or
    "native": no cap). A cap the CPU cannot reach gives the highest level below it
    that it can."""
    levels = levels or machine_levels()
    names = [level.name for level in levels]
    if cap in (None, "", "native"):
        ceiling = len(levels) - 1
    elif cap in names:
        ceiling = names.index(cap)
    else:
        raise UnknownIsaError(f"KVSERVE_CPU_ISA={cap!r}: this {platform.machine()} machine's "
                              f"levels are {', '.join(names + ['native'])}")
    runnable = [level for level in levels[:ceiling + 1] if level.requires <= features]
    return runnable[-1]


def requested_cap() -> str | None:
    return os.environ.get("KVSERVE_CPU_ISA") or None


def selected_level() -> IsaLevel:
    """The level this process runs: the CPU's best under KVSERVE_CPU_ISA."""
    return choose_level(cpu_features(), requested_cap())


def cap_torch(level: IsaLevel) -> None:
    """Keep torch's own CPU kernels at or below `level` as well (ATen's dispatch and
    oneDNN read these once, at their first use): call before any torch op runs. An
    explicit ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA in the environment wins."""
    os.environ.setdefault("ATEN_CPU_CAPABILITY", level.torch_capability)
    onednn = {"generic": "SSE41", "avx2": "AVX2", "avx_vnni": "AVX2_VNNI"}.get(level.name)
    if onednn:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)


TORCH_CAPABILITIES = ("default", "avx2", "avx512")
"""ATEN_CPU_CAPABILITY's values, lowest first."""


def torch_held_below_cpu() -> str | None:
    """ATEN_CPU_CAPABILITY's value where it holds torch below this CPU's best level
    (cap_torch under --cpu-isa, or the environment), else None. inductor's CPU code
    then disagrees with ATen's (a tiny Llama's compiled steps gave token 0 throughout
    on an AVX-512 host held to avx2), so compile_paths.plan_compile refuses there."""
    held = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    best = choose_level(cpu_features()).torch_capability
    if held in TORCH_CAPABILITIES and best in TORCH_CAPABILITIES \
            and TORCH_CAPABILITIES.index(held) < TORCH_CAPABILITIES.index(best):
        return held
    return None

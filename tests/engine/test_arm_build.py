"""The native kernels' AArch64 builds (engine/kernels/isa.py's ARM_LEVELS), cross-compiled
and run under qemu-user: every level builds, reports its int8 loop, and computes what the
generic level's plain C and the float64 references compute (tests/native/check_kernels.c,
run by tests/native/run_arm_checks.py). Skipped where the cross compiler or qemu is
missing (`make arm-tools` installs them as root)."""

from __future__ import annotations

import platform

import pytest

from engine.kernels.isa import ARM_LEVELS
from tests.native import run_arm_checks

MISSING = run_arm_checks.missing_tools()


@pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} "
                                          f"({run_arm_checks.INSTALL_HINT})")
def test_every_arm_level_computes_what_the_generic_level_computes():
    result = run_arm_checks.run_arm_checks()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "all match" in result.stdout
    for level in ARM_LEVELS:        # each level reports its own loops: the generic one
        lanes = 1 if level.name == "generic" else 4          # plain C, the others NEON
        assert (f"{level.name}: int8_path {run_arm_checks.int8_code(level)}, "
                f"block_gemm_lanes {lanes}") in result.stdout


def test_the_checks_pass_on_this_machines_own_levels():
    """The same program natively on the host's x86 levels (their AVX2 and AVX-512
    paths against the generic build): the check program itself is sound."""
    if platform.machine() != "x86_64":
        pytest.skip("checks the x86-64 levels")
    result = run_arm_checks.run_host_checks()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "all match" in result.stdout

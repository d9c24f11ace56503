"""Build the native kernel library for every AArch64 ISA level with a cross compiler
and check its routines under qemu-user (`make test-arm`; tests/engine/test_arm_build.py).

Each level of engine/kernels/isa.py's ARM_LEVELS is built from build.py's SOURCES by
build.py's own build_library, with the level's flags, so these are the libraries an
ARM machine would build. The check program (check_kernels.c and its check_*.c) loads
them all with dlopen and compares every level with float64 references and with the
generic level's plain C (see check_kernels.c). Builds are kept under build/native-checks/,
keyed by the sources, the compiler and the flags.

`--host` runs the same program natively on the x86 levels this CPU runs (the
libraries load_native_kernels builds), which checks the check program itself.
Without the cross compiler or qemu the checks are skipped (exit 0, saying how to get
them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:        # run as a script: the repository's packages
    sys.path.insert(0, str(ROOT))

from engine.kernels.build import HEADERS, INCLUDE_FLAGS, SOURCES, build_library  # noqa: E402
from engine.kernels.isa import ARM_LEVELS, X86_LEVELS, IsaLevel, cpu_features  # noqa: E402
from engine.kernels.native import INT8_PATHS  # noqa: E402

HERE = Path(__file__).resolve().parent
CHECK_SOURCES = [HERE / "check_kernels.c", HERE / "check_forms.c", HERE / "check_layer_ops.c",
                 HERE / "check_bf16_gemm.c"]
CHECK_HEADERS = [HERE / "check_forms.h", HERE / "check_library.h"]
CROSS_COMPILER = os.environ.get("ARM_CC", "aarch64-linux-gnu-gcc")
QEMU = "qemu-aarch64-static"
SYSROOT = "/usr/aarch64-linux-gnu"            # Debian's libc6-dev-arm64-cross
BUILD_DIR = ROOT / "build" / "native-checks"
INSTALL_HINT = "apt-get install gcc-aarch64-linux-gnu qemu-user-static libc6-dev-arm64-cross"
RUN_TIMEOUT = 600


def missing_tools() -> list[str]:
    """The tools the ARM checks need that this machine lacks."""
    missing = [tool for tool in (CROSS_COMPILER, QEMU) if shutil.which(tool) is None]
    return missing + ([] if Path(SYSROOT, "lib").is_dir() else [f"{SYSROOT}/lib"])


def int8_code(level: IsaLevel) -> int:
    """int8_path() an ARM level's library must report (native.py's INT8_PATHS): its
    generic level keeps to the portable loop, the others have their own."""
    codes = {name: code for code, name in INT8_PATHS.items()}
    return codes["portable" if level.name == "generic" else level.name]


def _build_key(compiler: str, levels: tuple[IsaLevel, ...]) -> str:
    version = subprocess.run([compiler, "-dumpfullversion"], capture_output=True, text=True,
                             check=True).stdout
    digest = hashlib.sha256(compiler.encode() + version.encode())
    for path in SOURCES + HEADERS + CHECK_SOURCES + CHECK_HEADERS:
        digest.update(path.read_bytes())
    for level in levels:
        digest.update(" ".join((level.name,) + level.flags).encode())
    return digest.hexdigest()[:16]


def build_check(compiler: str, target: Path) -> None:
    """The check program, built with `compiler` into `target` (warnings shown)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        partial = Path(staging) / target.name
        result = subprocess.run(
            [compiler, "-O2", "-Wall", "-Wextra", *INCLUDE_FLAGS, "-o",
             str(partial), *map(str, CHECK_SOURCES), "-ldl", "-lm"],
            capture_output=True, text=True, timeout=120, check=True)
        if result.stderr.strip():
            print(result.stderr.strip(), file=sys.stderr)
        os.replace(partial, target)


def build_arm(build_dir: Path = BUILD_DIR) -> tuple[Path, list[tuple[IsaLevel, Path]]]:
    """The check program and one library per ARM level (built when not yet there)."""
    compiler = shutil.which(CROSS_COMPILER)
    folder = build_dir / f"aarch64-{_build_key(compiler, ARM_LEVELS)}"
    libraries = []
    for level in ARM_LEVELS:
        target = folder / f"kvserve_kernels-{level.name}.so"
        if not target.is_file():
            build_library(compiler, level.flags, target)
        libraries.append((level, target))
    check = folder / "check_kernels"
    if not check.is_file():
        build_check(compiler, check)
    return check, libraries


def run_arm_checks(build_dir: Path = BUILD_DIR) -> subprocess.CompletedProcess:
    """Build, then run the check program under qemu on the ARM levels' libraries."""
    check, libraries = build_arm(build_dir)
    specs = [f"{level.name}:{path}:{int8_code(level)}" for level, path in libraries]
    return subprocess.run([shutil.which(QEMU), "-L", SYSROOT, "-cpu", "max", str(check),
                           *specs], capture_output=True, text=True, timeout=RUN_TIMEOUT)


def run_host_checks(build_dir: Path = BUILD_DIR) -> subprocess.CompletedProcess:
    """The check program natively on the x86 levels this CPU runs."""
    from engine.kernels import load_native_kernels

    features = cpu_features()
    levels = [level for level in X86_LEVELS if level.requires <= features]
    specs = []
    for level in levels:
        kernels = load_native_kernels(level=level)
        if kernels is None:
            raise RuntimeError(f"the {level.name} level's library does not build here")
        specs.append(f"{level.name}:{kernels.path}")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    check = build_dir / f"host-{_build_key(compiler, tuple(levels))}" / "check_kernels"
    if not check.is_file():
        build_check(compiler, check)
    return subprocess.run([str(check), *specs], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="store_true",
                        help="check this machine's x86 levels natively instead")
    args = parser.parse_args()
    if not args.host and missing_tools():
        print(f"skipped: the ARM checks need {', '.join(missing_tools())} ({INSTALL_HINT})")
        return 0
    start = time.monotonic()
    try:
        result = run_host_checks() if args.host else run_arm_checks()
    except subprocess.CalledProcessError as error:
        print(f"build failed: {' '.join(map(str, error.cmd))[:300]}\n{error.stderr}",
              file=sys.stderr)
        return 1
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    print(f"native checks: exit {result.returncode} in {time.monotonic() - start:.1f} s")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())

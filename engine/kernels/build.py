"""Build and load the engine's native CPU kernels (their Python front is native.py):
matrix products on GGUF weight blocks (block_gemm.c, block_mlp.c, block_panels.c; on
int8 activations, block_int8.c) and the parsing of a file's rows into them
(block_parse.c),
decode attention over the paged cache (paged_attention.c, attention_vectors.c) and of prefill chunks (prefill_attention.c; a mixed step's chunk
rows found by step_runs.c), a decoder
layer's elementwise parts (layer_ops.c, activations.c), the fast decode layer's two
halves (decode_layer.c), a step's whole layer stack on bf16 weights
(decoder_stack.c), the bf16 LM head's finish (head_rescore.c) and greedy picks
(argmax.c), sharing one pool of helper threads (worker_pool.c).

The C files are compiled with the system C compiler (`cc -O3 -pthread` and the target
flags of one ISA level, isa.py: generic, avx2, avx512 ... on x86, generic, neon,
dotprod on ARM) into one library per level under `<cache>/kernels/`, keyed by the
sources, the compiler and the level's flags, and loaded with ctypes; ctypes releases
the GIL during each call. The level is the CPU's best, capped by KVSERVE_CPU_ISA. Without a compiler, or when the build fails,
`load_native_kernels()` returns None (logged once) and callers keep their torch
path. KVSERVE_NATIVE_KERNELS=0 turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..loading.cache_folder import usable_cache_dir
from .isa import IsaLevel, cpu_features, selected_level
from .native import NativeKernels

logger = logging.getLogger(__name__)

KERNELS = Path(__file__).parent
ARCH_DIRS = (KERNELS / "arch" / "x86", KERNELS / "arch" / "arm")
"""Each architecture's own tiles (ggml-cpu's layout): the AVX2 / AVX-512 / AMX ones
under arch/x86, the NEON ones under arch/arm. The portable loops, the dispatch and
the shared headers stay in engine/kernels; every file finds a header by its name
across these folders (build_library's -I)."""
SOURCES = [KERNELS / name
           for name in ("block_gemm.c", "block_mlp.c", "block_panels.c",
                        "paged_attention.c", "step_runs.c", "attention_vectors.c",
                        "attention_bf16.c", "prefill_attention.c",
                        "bf16_gemm.c", "activations.c", "head_rescore.c", "argmax.c",
                        "layer_ops.c", "decode_layer.c", "decoder_stack.c", "worker_pool.c",
                        "block_int8.c", "block_parse.c")] + [ARCH_DIRS[0] / "bf16_amx.c"]
HEADERS = sorted(KERNELS.glob("*.h")) + sorted(path for arch in ARCH_DIRS
                                               for path in arch.glob("*.h"))
INCLUDE_FLAGS = tuple(f"-I{folder}" for folder in (KERNELS, *ARCH_DIRS))
_lock = threading.Lock()
_loaded: dict[tuple[str, str], "NativeKernels | None"] = {}


def default_num_threads() -> int:
    """Threads a kernel call may use: OMP_NUM_THREADS when set (torchrun sets 1 per
    rank), else the CPUs this process may run on. Not torch.get_num_threads(): the
    engine lowers that to 1 for small steps."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def build_library(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile SOURCES with the target `flags` into the shared library `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        partial = Path(staging) / target.name
        subprocess.run([compiler, "-O3", *flags, *INCLUDE_FLAGS, "-pthread", "-shared", "-fPIC",
                        "-o", str(partial), *map(str, SOURCES), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)      # atomic: concurrent builders never see half a file


def load_native_kernels(cache_dir: Path | None = None,
                        level: IsaLevel | None = None) -> NativeKernels | None:
    """The kernels compiled for `level` (default: selected_level(), the CPU's best
    under KVSERVE_CPU_ISA), or None when they cannot be built here (any thread)."""
    if os.environ.get("KVSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    root = usable_cache_dir(cache_dir)
    level = level or selected_level()
    with _lock:
        if (str(root), level.name) in _loaded:
            return _loaded[str(root), level.name]
        kernels = None
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            logger.info("no C compiler: native kernels off, torch ops serve")
        else:
            try:
                flags = level.compiler_flags(cpu_features())
                sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
                key = hashlib.sha256(sources + compiler.encode()
                                     + " ".join(flags).encode()).hexdigest()[:16]
                target = root / "kernels" / f"kvserve_kernels-{level.name}-{key}.so"
                if not target.is_file():
                    build_library(compiler, flags, target)
                kernels = NativeKernels(ctypes.CDLL(str(target)), default_num_threads(),
                                        level.name)
                logger.info("native kernels: %s level (%s): %s", level.name, " ".join(flags),
                            kernels.describe())
            except (OSError, subprocess.SubprocessError) as error:
                detail = getattr(error, "stderr", "") or error
                logger.warning("native kernels unavailable (%s): torch ops serve",
                               str(detail).strip()[:500])
        _loaded[str(root), level.name] = kernels
        return kernels


_default: dict[str | None, "NativeKernels | None"] = {}


def default_kernels() -> NativeKernels | None:
    """load_native_kernels() for the default cache folder and the selected level,
    looked up once per KVSERVE_CPU_ISA value: for the per-op callers (norms,
    attention), which ask on every call (any thread)."""
    if torch.compiler.is_compiling():
        # a layer step traced by torch.compile takes the torch ops (compile_paths.py):
        # dynamo cannot trace a ctypes call
        return None
    cap = os.environ.get("KVSERVE_CPU_ISA")
    if cap not in _default:
        _default[cap] = load_native_kernels()
    return _default[cap]

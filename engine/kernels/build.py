"""Build and load the engine's native CPU kernels (their Python front is native.py):
matrix products on GGUF weight blocks (block_gemm.c, block_mlp.c, block_panels.c; on
int8 activations, block_int8.c) and the parsing of a file's rows into them
(block_parse.c),
decode attention over the paged cache (paged_attention.c, attention_vectors.c,
attention_avx2.c) and of prefill chunks (prefill_attention.c; a mixed step's chunk
rows found by step_runs.c), a decoder
layer's elementwise parts (layer_ops.c, activations.c), the fast decode layer's two
halves (decode_layer.c), a step's whole layer stack on bf16 weights
(decoder_stack.c), the bf16 LM head's finish (head_rescore.c) and greedy picks
(argmax.c), sharing one pool of helper threads (worker_pool.c).

The C files are compiled once per machine with the system C compiler (`cc -O3
-march=native -pthread`) into one library under `<cache>/kernels/`, keyed by the
sources, the compiler and the CPU's feature flags, and loaded with ctypes; ctypes
releases the GIL during each call. Without a compiler, or when the build fails,
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

from .native import NativeKernels

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("block_gemm.c", "block_mlp.c", "block_panels.c",
                        "paged_attention.c", "step_runs.c", "attention_vectors.c",
                        "attention_avx2.c", "attention_bf16.c", "prefill_attention.c",
                        "bf16_gemm.c", "activations.c", "head_rescore.c", "argmax.c",
                        "layer_ops.c", "decode_layer.c", "decoder_stack.c", "worker_pool.c",
                        "bf16_amx.c", "block_int8.c", "block_parse.c")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("worker_pool.h", "kernels.h", "vector_math.h", "block_rows.h",
                        "block_rows_avx512.h", "block_panels_avx512.h", "prefill_tiles.h")]
_lock = threading.Lock()
_loaded: dict[str, "NativeKernels | None"] = {}


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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        partial = Path(staging) / target.name
        subprocess.run([compiler, "-O3", "-march=native", "-pthread", "-shared", "-fPIC",
                        "-o", str(partial), *map(str, SOURCES), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(partial, target)      # atomic: concurrent builders never see half a file


def load_native_kernels(cache_dir: Path | None = None) -> NativeKernels | None:
    """The compiled kernels, or None when they cannot be built here (any thread)."""
    if os.environ.get("KVSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    from ..loading import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    with _lock:
        if str(root) in _loaded:
            return _loaded[str(root)]
        kernels = None
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            logger.info("no C compiler: native kernels off, torch ops serve")
        else:
            try:
                sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
                key = hashlib.sha256(sources + compiler.encode()
                                     + _cpu_flags().encode()).hexdigest()[:16]
                target = root / "kernels" / f"kvserve_kernels-{key}.so"
                if not target.is_file():
                    _build(compiler, target)
                kernels = NativeKernels(ctypes.CDLL(str(target)), default_num_threads())
            except (OSError, subprocess.SubprocessError) as error:
                detail = getattr(error, "stderr", "") or error
                logger.warning("native kernels unavailable (%s): torch ops serve",
                               str(detail).strip()[:500])
        _loaded[str(root)] = kernels
        return kernels


_default: list = []


def default_kernels() -> NativeKernels | None:
    """load_native_kernels() for the default cache folder, looked up once: for the
    per-op callers (norms, attention), which ask on every call (any thread)."""
    if torch.compiler.is_compiling():
        # a layer step traced by torch.compile takes the torch ops (compile_paths.py):
        # dynamo cannot trace a ctypes call
        return None
    if not _default:
        _default.append(load_native_kernels())
    return _default[0]

"""Build and load the engine's native CPU kernels: matrix products on GGUF weight
blocks (block_gemm.c) and decode attention over the paged cache (paged_attention.c),
sharing one pool of helper threads (worker_pool.c).

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

from ..cpu_threads import openmp_entry_points

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("block_gemm.c", "paged_attention.c", "attention_vectors.c",
                        "activations.c", "worker_pool.c")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("worker_pool.h", "kernels.h", "vector_math.h")]
_lock = threading.Lock()
_loaded: dict[str, "NativeKernels | None"] = {}


class NativeKernels:
    """ctypes front of the compiled library; every method takes and returns torch
    tensors on the CPU and checks what the C code relies on."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        library.q4_gemm.argtypes = [pointer, size, size, pointer, pointer, pointer, size,
                                    pointer, ctypes.c_int]
        library.q8_gemm.argtypes = [pointer, size, size, pointer, pointer, size, pointer,
                                    ctypes.c_int]
        library.set_helper_spin_ns.argtypes = [ctypes.c_longlong]
        library.q4_attention_block.argtypes = [
            pointer, size, size, pointer, ctypes.c_float, pointer, pointer, pointer, pointer,
            pointer, pointer, pointer, pointer, pointer, pointer, size, size, size, size,
            ctypes.c_float, pointer, pointer, pointer, pointer, ctypes.c_int]
        library.q4_mlp_block.argtypes = [
            pointer, size, size, pointer, ctypes.c_float, pointer, pointer, pointer, size,
            pointer, pointer, pointer, pointer, ctypes.c_int]
        library.q4_gated_mlp.argtypes = [pointer, size, size, pointer, pointer, pointer, size,
                                         pointer, pointer, pointer, size, pointer, ctypes.c_int]
        self._per_thread = threading.local()
        """torch_threaded and num_threads of the calling engine thread (engines on
        other threads choose for themselves)."""
        library.paged_decode_attention.argtypes = [
            pointer, pointer, pointer, pointer, pointer, size, size, size, size, size,
            ctypes.c_float, pointer, ctypes.c_int]
        self._library = library
        self._q4, self._q8 = library.q4_gemm, library.q8_gemm
        self.max_threads = num_threads
        library.silu_mul.argtypes = [pointer, size, size, ctypes.c_int, pointer, ctypes.c_int]
        library.set_openmp_runtime.argtypes = [pointer, pointer, pointer]
        library.use_openmp_helpers.argtypes = [ctypes.c_int]
        library.use_openmp_helpers.restype = ctypes.c_int
        entry_points = openmp_entry_points()
        if entry_points is not None:
            library.set_openmp_runtime(*entry_points)

    def gemm(self, kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
             minima: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] fp32 contiguous; kind "Q4_1" (codes [N, K/2] uint8, scales and
        minima [N, K/32] fp32) or "Q8_0" (codes [N, K] int8, scales) -> y [rows, N].
        Called ~120 times per decode step: kept to the bare calls."""
        rows, in_features = x.shape
        out_features = codes.shape[0]
        y = torch.empty(rows, out_features, dtype=torch.float32)   # never the default dtype
        if kind == "Q4_1":
            status = self._q4(x.data_ptr(), rows, in_features, codes.data_ptr(),
                              scales.data_ptr(), minima.data_ptr(), out_features,
                              y.data_ptr(), self.num_threads)
        else:
            status = self._q8(x.data_ptr(), rows, in_features, codes.data_ptr(),
                              scales.data_ptr(), out_features, y.data_ptr(), self.num_threads)
        if status:
            raise RuntimeError(f"{kind} kernel failed ({status}) for K={in_features}")
        return y

    @property
    def num_threads(self) -> int:
        """Parts each call is split into, on the calling thread."""
        return getattr(self._per_thread, "num_threads", self.max_threads)

    @num_threads.setter
    def num_threads(self, value: int) -> None:
        self._per_thread.num_threads = value

    def set_torch_threaded(self, torch_threaded: bool) -> None:
        """Whether torch runs its own threads between this thread's calls (large
        steps). Its idle OpenMP helpers spin on the other cores then: our calls run
        on that same team (torch's libgomp), as many parts as torch has threads, and
        our own pool's helpers sleep at once. In single-threaded steps the pool
        serves, its helpers spinning 2 ms between calls (see worker_pool.h).
        Measured: one 32 x 9-head x 100-token paged attention call after a
        two-thread torch matmul took 1.6 ms on the calling thread alone (torch's
        spinning helper slows it) against 0.49 ms after nothing."""
        if torch_threaded != getattr(self._per_thread, "torch_threaded", None):
            self._library.set_helper_spin_ns(0 if torch_threaded else 2_000_000)
            openmp = self._library.use_openmp_helpers(int(torch_threaded))
            self.num_threads = (torch.get_num_threads() if openmp else 1) if torch_threaded \
                else self.max_threads
            self._per_thread.torch_threaded = torch_threaded

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] fp32 or bf16, contiguous (gate columns first) ->
        silu(gate) * up [T, I] in the same dtype, computed in fp32 (activations.c)."""
        if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.dim() != 2 \
                or gate_up.shape[1] % 2 or gate_up.device.type != "cpu":
            raise ValueError("silu_mul: gate_up must be a [T, 2I] CPU fp32 or bf16 tensor")
        gate_up = gate_up.contiguous()
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype)
        self._library.silu_mul(gate_up.data_ptr(), tokens, inter,
                               int(gate_up.dtype == torch.bfloat16), out.data_ptr(),
                               self.num_threads)
        return out

    def paged_decode_attention(self, query: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, slots: torch.Tensor,
                               lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """query [B, H, D] fp32; keys, values [num_slots, KVH, D] fp32 (the flat
        cache); slots [B, L] long, row b valid on its first lengths[b] entries ->
        out [B, H, D] (see paged_attention.c)."""
        query, slots, lengths = query.contiguous(), slots.contiguous(), lengths.contiguous()
        for name, tensor, dtype in (("query", query, torch.float32), ("keys", keys, torch.float32),
                                    ("values", values, torch.float32), ("slots", slots, torch.int64),
                                    ("lengths", lengths, torch.int64)):
            if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"paged_decode_attention: {name} must be a contiguous CPU "
                                 f"{dtype} tensor")
        batch, heads, dim = query.shape
        out = torch.empty(batch, heads, dim, dtype=torch.float32)
        status = self._library.paged_decode_attention(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
            lengths.data_ptr(), batch, slots.shape[1], heads, keys.shape[1], dim, scale,
            out.data_ptr(), self.num_threads)
        if status:
            raise RuntimeError(f"paged_decode_attention failed ({status})")
        return out

    def gated_mlp(self, x: torch.Tensor, gate_up, down) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) in one call; x [rows, K] fp32 contiguous;
        `gate_up` ([2I, K], gate rows first) and `down` ([N, I]) are Q4_1 BlockLinears
        without bias -> [rows, N]."""
        rows, in_features = x.shape
        out_features = down.codes.shape[0]
        y = torch.empty(rows, out_features, dtype=torch.float32)
        status = self._library.q4_gated_mlp(
            x.data_ptr(), rows, in_features, gate_up.codes.data_ptr(), gate_up.scales.data_ptr(),
            gate_up.minima.data_ptr(), gate_up.codes.shape[0] // 2, down.codes.data_ptr(),
            down.scales.data_ptr(), down.minima.data_ptr(), out_features, y.data_ptr(),
            self.num_threads)
        if status:
            raise RuntimeError(f"q4_gated_mlp failed ({status}) for K={in_features}")
        return y

    def attention_block(self, x: torch.Tensor, norm, qkv, o_proj, cos: torch.Tensor,
                        sin: torch.Tensor, slot_mapping: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                        heads: int, scale: float) -> torch.Tensor:
        """x + o_proj(attention(rope(qkv(rms_norm(x))))) for a decode step of T
        requests, writing their new K/V into the flat caches first (the attention half
        of a Llama layer, paged_attention.c). x [T, hidden]; cos, sin [T, D]; the
        projections are Q4_1 BlockLinears; the rest as in paged_decode_attention.
        The caller guarantees fp32, CPU, contiguous tensors (FastDecodeLayer)."""
        tokens, hidden = x.shape
        kv_heads, dim = keys.shape[1], keys.shape[2]
        y = torch.empty(tokens, hidden, dtype=torch.float32)
        status = self._library.q4_attention_block(
            x.data_ptr(), tokens, hidden, norm.weight.data_ptr(), norm.eps,
            qkv.codes.data_ptr(), qkv.scales.data_ptr(), qkv.minima.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), keys.data_ptr(),
            values.data_ptr(), slots.data_ptr(), lengths.data_ptr(), slots.shape[1], heads,
            kv_heads, dim, scale, o_proj.codes.data_ptr(), o_proj.scales.data_ptr(),
            o_proj.minima.data_ptr(), y.data_ptr(), self.num_threads)
        if status:
            raise RuntimeError(f"q4_attention_block failed ({status})")
        return y

    def mlp_block(self, x: torch.Tensor, norm, gate_up, down) -> torch.Tensor:
        """x + down(silu(gate(h)) * up(h)), h = rms_norm(x): the MLP half of a Llama
        layer in one call (block_gemm.c); same guarantees as attention_block."""
        tokens, hidden = x.shape
        y = torch.empty(tokens, hidden, dtype=torch.float32)
        status = self._library.q4_mlp_block(
            x.data_ptr(), tokens, hidden, norm.weight.data_ptr(), norm.eps,
            gate_up.codes.data_ptr(), gate_up.scales.data_ptr(), gate_up.minima.data_ptr(),
            gate_up.codes.shape[0] // 2, down.codes.data_ptr(), down.scales.data_ptr(),
            down.minima.data_ptr(), y.data_ptr(), self.num_threads)
        if status:
            raise RuntimeError(f"q4_mlp_block failed ({status})")
        return y


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

"""NativeKernels: the ctypes front of the compiled kernel library (build.py builds
and loads it). Every method takes and returns CPU torch tensors and checks what the
C code relies on; ctypes releases the GIL during each call."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from .cpu_threads import openmp_entry_points
from .block_types import BLOCK_KINDS, PARSE_CODES


_ARGUMENT_TYPES = {"p": ctypes.c_void_p, "s": ctypes.c_int64, "i": ctypes.c_int,
                   "f": ctypes.c_float, "l": ctypes.c_longlong}

SIGNATURES = {
    # the C prototypes' arguments: p pointer, s int64_t, i int, f float, l long long
    "q4_gemm": "psspppspi", "q8_gemm": "pssppspi", "set_helper_spin_ns": "l",
    "block_gemm": "ipsspppspsi",
    "block_attention_half": "ppppspi", "block_mlp_half": "pppspi",
    "blocks_gated_mlp": "psspspsipi", "paged_decode_attention": "psppipppsspsssssfpi",
    "gated_activation": "pssiipi", "rms_norm": "psspfpii", "rope_store": "psssspppppsii",
    "argmax_rows": "psspi", "attention_vectors_apply": "s", "rescore_head": "pppsssspi",
    "bf16_gemm": "pspssspsisi", "bf16_gated_gemm": "pspssspsii",
    "set_openmp_runtime": "ppp", "use_openmp_helpers": "i", "bf16_amx_enable": "i",
    "bf16_decoder_stack": "psppspsi", "block_decoder_stack": "psppspsi",
    "prefill_attention_apply": "s", "prefill_attention_bf16": "pspppsssssssssfpsi",
    "parse_gguf_rows": "ipsssspisspppi",
}


INT8_PATHS = {0: "portable", 1: "avx2", 2: "avx_vnni", 3: "avx512_vnni", 4: "neon",
              5: "dotprod"}
"""int8_path()'s codes (kernels.h's INT8_*): the int8-activation kernels' loop."""

BF16_GEMMS = {0: "none", 1: "avx512_bf16", 2: "widening"}
"""bf16_gemm_available()'s codes (kernels.h's BF16_GEMM_*): how the native bf16 GEMM
multiplies, AVX512-BF16 dot products or fp32 FMAs on weights widened in registers
(AVX2), or "none" (no such GEMM in this build)."""

GATED_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}
"""The activations bf16_gated_gemm fuses (kernels.h's ACTIVATION_* codes)."""

FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""config.hidden_act names -> the GATED_ACTIVATIONS name the kernels compute for them."""


SLOT_OUTSIDE_CACHE = 9
"""The native calls' status for a slot outside the cache (kernels.h's
STATUS_SLOT_OUTSIDE_CACHE: paged_attention.c's check_slots, rope_store, decode_layer.c's
K/V stores): a step's metadata names cache memory that is not there."""


def kernel_failure(name: str, status: int) -> Exception:
    """The exception for a native call's nonzero status."""
    if status == SLOT_OUTSIDE_CACHE:
        return IndexError(f"{name}: a slot outside the KV cache (status {status})")
    return RuntimeError(f"{name} failed ({status})")


class NativeKernels:
    """ctypes front of the compiled library; every method takes and returns torch
    tensors on the CPU and checks what the C code relies on."""

    def __init__(self, library: ctypes.CDLL, num_threads: int, isa: str = "native") -> None:
        self.isa = isa
        """The ISA level the library was built for (isa.py's IsaLevel.name)."""
        for name, signature in SIGNATURES.items():
            getattr(library, name).argtypes = [_ARGUMENT_TYPES[c] for c in signature]
        library.use_openmp_helpers.restype = ctypes.c_int
        self._library = library
        self.path = library._name
        """The shared library's file."""
        self._block_gemm = library.block_gemm
        self.max_threads = num_threads
        self._per_thread = threading.local()
        """torch_threaded and num_threads of the calling engine thread (engines on
        other threads choose for themselves)."""
        self.bf16_gemm_kind = BF16_GEMMS[library.bf16_gemm_available()]
        """How bf16_gemm multiplies (BF16_GEMMS): "avx512_bf16", "widening" or "none"."""
        self.has_bf16_gemm = self.bf16_gemm_kind != "none"
        self.amx_enabled = False
        """Whether bf16_gemm multiplies on AMX tiles (bf16_amx.c; KVSERVE_AMX=0 keeps
        the AVX512-BF16 loop); set by enable_amx."""
        if self.bf16_gemm_kind == "avx512_bf16":
            self.enable_amx(os.environ.get("KVSERVE_AMX", "1") != "0")
        self.block_lanes = int(library.block_gemm_lanes())
        """16 (AVX-512), 8 (AVX2), 4 (AArch64's NEON) or 1: the vectors of the block
        kernels (block_gemm.c)."""
        self.int8_path = INT8_PATHS[library.int8_path()]
        """The loop of the int8-activation kernels (block_int8.c): "avx512_vnni",
        "avx_vnni", "avx2", "dotprod" or "neon" (AArch64), or "portable" (correct, but
        many times slower than float32's kernels: load_model refuses int8-activations
        on it)."""
        entry_points = openmp_entry_points()
        if entry_points is not None:
            library.set_openmp_runtime(*entry_points)

    def describe(self) -> str:
        """Which routines this build runs, for the load log."""
        attention = ("vector passes" if self._library.attention_vectors_apply(64)
                     else "scalar loops")
        bf16 = {"avx512_bf16": "AMX tiles" if self.amx_enabled else "AVX512-BF16",
                "widening": "widened to fp32 FMAs", "none": "none"}[self.bf16_gemm_kind]
        return (f"block kernels on {self.block_lanes} lanes, int8 loop {self.int8_path}, "
                f"attention {attention}, bf16 GEMM {bf16}")

    def gemm(self, kind: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
             minima: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, K] fp32 contiguous; kind "Q4_1" (codes [N, K/2] uint8, scales and
        minima [N, K/32] fp32), "Q5_1" (codes [N, K] int8, scales and minima [N, K/32]),
        "Q8_0" (codes [N, K] int8, scales [N, K/32]) or "Q8_16" (codes [N, K] int8,
        scales [N, K/16]) -> y [rows, N], written into `out` when
        given (fp32 [rows, N] with unit column stride, e.g. a column slice of a wider
        output). Called ~120 times per decode step: kept to the bare calls."""
        rows, in_features = x.shape
        out_features = codes.shape[0]
        y = torch.empty(rows, out_features, dtype=torch.float32) if out is None else out
        status = self._block_gemm(BLOCK_KINDS[kind], x.data_ptr(), rows, in_features,
                                  codes.data_ptr(), scales.data_ptr(),
                                  None if minima is None else minima.data_ptr(), out_features,
                                  y.data_ptr(), y.stride(0), self.num_threads)
        if status:
            raise RuntimeError(f"{kind} kernel failed ({status}) for K={in_features}")
        return y

    def parse_gguf(self, kind: str, raw: torch.Tensor, out, start: int,
                   order: torch.Tensor | None) -> None:
        """GGUF bytes raw [N, row bytes] uint8 of type `kind` (block_types.PARSE_CODES) into rows
        [start, start + N) of `out` (models/block_formats.py's Blocks or int8_blocks.py's
        Int8Blocks, contiguous), row i from raw's row order[i] (int64) when given:
        block_formats.parse_blocks's values, in one pass (block_parse.c)."""
        raw_rows, row_bytes = raw.shape
        rows = raw_rows if order is None else order.shape[0]
        if not (raw.is_contiguous() and (order is None or (order.dtype == torch.int64
                                                           and order.is_contiguous()))):
            raise ValueError("parse_gguf: raw and order must be contiguous, order int64")
        status = self._library.parse_gguf_rows(
            PARSE_CODES[kind], raw.data_ptr(), rows, out.shape[1], row_bytes, raw_rows,
            None if order is None else order.data_ptr(), BLOCK_KINDS[out.kind], start,
            out.shape[0], out.codes.data_ptr(), out.scales.data_ptr(),
            None if out.minima is None else out.minima.data_ptr(), self.num_threads)
        if status:
            raise ValueError(f"cannot parse {rows} {kind} rows of {row_bytes} bytes "
                             f"({raw_rows} given) into rows {start}.. of a {out.kind} weight "
                             f"of {out.shape[0]} rows and {out.shape[1]} columns")

    def bf16_gemm(self, x: torch.Tensor, pairs: torch.Tensor, out_features: int,
                  out_dtype: torch.dtype, gated_inter: int = 0,
                  activation: str | None = None) -> torch.Tensor:
        """x [rows, K] bf16 (rows may be strided) @ W^T -> [rows, out_features] fp32 or
        bf16; W packed in pairs [ceil(N / 16), K / 2, 16, 2] bf16 (bf16_gemm.c), or in
        a gated MLP's alternating gate/up blocks when gated_inter > 0, and with an
        `activation` ("silu" or "gelu_tanh", see GATED_ACTIVATIONS) act(gate) * up
        [rows, gated_inter] bf16 instead. The caller guarantees CPU tensors of those
        dtypes, pairs contiguous, K even."""
        rows, library = x.shape[0], self._library
        if x.stride(1) != 1:
            x = x.contiguous()
        if activation:
            y = torch.empty(rows, gated_inter, dtype=torch.bfloat16)
            status = library.bf16_gated_gemm(x.data_ptr(), x.stride(0), pairs.data_ptr(), rows,
                                             x.shape[1], gated_inter, y.data_ptr(), gated_inter,
                                             GATED_ACTIVATIONS[activation], self.num_threads)
        else:
            y = torch.empty(rows, out_features, dtype=out_dtype)
            status = library.bf16_gemm(x.data_ptr(), x.stride(0), pairs.data_ptr(), rows,
                                       x.shape[1], out_features, y.data_ptr(), out_features,
                                       int(out_dtype == torch.bfloat16), gated_inter,
                                       self.num_threads)
        if status:
            raise RuntimeError(f"bf16 GEMM failed ({status}) for K={x.shape[1]}")
        return y

    def enable_amx(self, wanted: bool) -> bool:
        """Turn the bf16 GEMM's AMX tiles on (where this CPU and Linux allow them) or
        off for the whole process; returns whether they serve. Not while a GEMM runs."""
        self.amx_enabled = bool(self._library.bf16_amx_enable(int(wanted)))
        return self.amx_enabled

    @property
    def library(self) -> ctypes.CDLL:
        """The loaded library, for composite kernels fronted by their callers
        (models/packed_stack.py)."""
        return self._library

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
        After a threaded torch op, torch's helpers still spin on the other cores and
        slow any call that ignores them, even one on the calling thread alone."""
        if torch_threaded != getattr(self._per_thread, "torch_threaded", None):
            self._library.set_helper_spin_ns(0 if torch_threaded else 2_000_000)
            openmp = self._library.use_openmp_helpers(int(torch_threaded))
            self.num_threads = (torch.get_num_threads() if openmp else 1) if torch_threaded \
                else self.max_threads
            self._per_thread.torch_threaded = torch_threaded

    def gated_activation(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """gate_up [T, 2I] fp32 or bf16, contiguous (gate columns first) ->
        act(gate) * up [T, I] in the same dtype, computed in fp32 (activations.c);
        activation: a GATED_ACTIVATIONS name (SiLU, GELU's tanh form)."""
        if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.dim() != 2 \
                or gate_up.shape[1] % 2 or gate_up.device.type != "cpu":
            raise ValueError("gated_activation: gate_up must be a [T, 2I] CPU fp32 or bf16 "
                             "tensor")
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"gated_activation: unknown activation {activation!r}")
        gate_up = gate_up.contiguous()
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype)
        self._library.gated_activation(gate_up.data_ptr(), tokens, inter,
                                       int(gate_up.dtype == torch.bfloat16),
                                       GATED_ACTIVATIONS[activation], out.data_ptr(),
                                       self.num_threads)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [T, n] fp32 contiguous, weight [n] fp32 -> the RMSNorm [T, n] in fp32 or
        bf16 (layer_ops.c). The caller guarantees CPU tensors of those dtypes."""
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=out_dtype)
        self._library.rms_norm(x.data_ptr(), rows, n, weight.data_ptr(), eps, out.data_ptr(),
                               int(out_dtype == torch.bfloat16), self.num_threads)
        return out

    def rope_store(self, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rotate the q and k heads of qkv [T, (H + 2 KVH) * D] in place and write each
        token's k and v to its slot of the flat caches keys, values [slots, KVH, D], fp32
        or bf16 (layer_ops.c). cos, sin [T, D]; slot_mapping [T] int64. The caller
        guarantees contiguous CPU tensors of those dtypes, qkv fp32."""
        kv_heads, dim = keys.shape[1], keys.shape[2]
        status = self._library.rope_store(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, dim,
                                          cos.data_ptr(), sin.data_ptr(),
                                          slot_mapping.data_ptr(), keys.data_ptr(),
                                          values.data_ptr(), keys.shape[0],
                                          int(keys.dtype == torch.bfloat16), self.num_threads)
        if status == 1:
            raise ValueError(f"rope_store: head size {dim} must be even")
        if status:
            raise kernel_failure(f"rope_store (slots must lie in [0, {keys.shape[0]}))", status)

    def vector_attention(self, head_dim: int) -> bool:
        """Whether attention of this head size runs on vector passes here (AVX-512:
        multiples of 16, AVX2: of 8, up to 256; else the kernel's scalar loops, slower
        than torch's SDPA for prefill chunks)."""
        return bool(self._library.attention_vectors_apply(head_dim))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] fp32 contiguous on the CPU -> [S] int64, torch.argmax(dim=-1)'s
        picks (argmax.c)."""
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if self._library.argmax_rows(logits.data_ptr(), rows, vocab, out.data_ptr(),
                                     self.num_threads):
            raise ValueError(f"argmax: rows of 1 .. 2^31 - 1 values, got {vocab}")
        return out

    def rescore_head(self, approx: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     candidates: int) -> torch.Tensor:
        """approx [N, V] bf16 logits, hidden [N, H] fp32, weight [V, H] fp32 -> fp32
        logits [N, V]: each row's `candidates` best recomputed exactly, every other
        logit capped below them (head_rescore.c)."""
        for name, tensor, dtype in (("approx", approx, torch.bfloat16),
                                    ("hidden", hidden, torch.float32),
                                    ("weight", weight, torch.float32)):
            if tensor.dtype != dtype or tensor.dim() != 2 or tensor.device.type != "cpu":
                raise ValueError(f"rescore_head: {name} must be a 2-D CPU {dtype} tensor")
        approx, hidden, weight = approx.contiguous(), hidden.contiguous(), weight.contiguous()
        rows, vocab = approx.shape
        if hidden.shape[0] != rows or weight.shape != (vocab, hidden.shape[1]):
            raise ValueError("rescore_head: approx [N, V], hidden [N, H], weight [V, H]")
        logits = torch.empty(rows, vocab, dtype=torch.float32)
        if self._library.rescore_head(approx.data_ptr(), hidden.data_ptr(), weight.data_ptr(),
                                      rows, vocab, hidden.shape[1], candidates,
                                      logits.data_ptr(), self.num_threads):
            raise ValueError(f"rescore_head: candidates must be 1..min(vocab, 64), "
                             f"got {candidates}")
        return logits

    def paged_decode_attention(self, query: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, slots: torch.Tensor,
                               lengths: torch.Tensor, scale: float,
                               slot_rows: torch.Tensor | None = None,
                               starts: torch.Tensor | None = None) -> torch.Tensor:
        """query [B, H, D] fp32, each query's [H, D] contiguous (rows may be strided,
        e.g. the q part of a fused qkv); keys, values [num_slots, KVH, D] (the flat
        cache), both fp32 or both bf16; slots [R, L] long; query b attends to
        lengths[b] slots of row slot_rows[b] (row b without slot_rows) from entry
        starts[b] (0 without starts) -> out [B, H, D] fp32 (see paged_attention.c)."""
        batch, heads, dim = query.shape
        if query.stride(2) != 1 or query.stride(1) != dim:
            query = query.contiguous()
        slots, lengths = slots.contiguous(), lengths.contiguous()
        if (lengths.shape != (batch,) or keys.dim() != 3 or keys.shape[2] != dim
                or values.shape != keys.shape or slots.dim() != 2):
            raise ValueError("paged_decode_attention: query [B, H, D], keys and values "
                             "[slots, KVH, D], slots [R, L], lengths [B]")
        if slot_rows is not None:
            slot_rows = slot_rows.contiguous()
            if slot_rows.dtype != torch.int64 or slot_rows.shape != (batch,):
                raise ValueError("paged_decode_attention: slot_rows must be [B] int64")
        elif slots.shape[0] != batch:
            raise ValueError("paged_decode_attention: one slots row per query without slot_rows")
        if starts is not None:
            starts = starts.contiguous()
            if starts.dtype != torch.int64 or starts.shape != (batch,):
                raise ValueError("paged_decode_attention: starts must be [B] int64")
        cache_dtype = keys.dtype if keys.dtype == torch.bfloat16 else torch.float32
        for name, tensor, dtype in (("query", query.select(0, 0) if batch else query,
                                     torch.float32), ("keys", keys, cache_dtype),
                                    ("values", values, cache_dtype), ("slots", slots, torch.int64),
                                    ("lengths", lengths, torch.int64)):
            if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError(f"paged_decode_attention: {name} must be a contiguous CPU "
                                 f"{dtype} tensor")
        out = torch.empty(batch, heads, dim, dtype=torch.float32)
        status = self._library.paged_decode_attention(
            query.data_ptr(), query.stride(0), keys.data_ptr(), values.data_ptr(),
            int(cache_dtype == torch.bfloat16), slots.data_ptr(),
            None if slot_rows is None else slot_rows.data_ptr(),
            None if starts is None else starts.data_ptr(), slots.shape[0], keys.shape[0],
            lengths.data_ptr(), batch, slots.shape[1], heads, keys.shape[1], dim, scale,
            out.data_ptr(), self.num_threads)
        if status:
            raise kernel_failure("paged_decode_attention", status)
        return out

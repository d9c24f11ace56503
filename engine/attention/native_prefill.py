"""Long prefill chunks over a bf16 CPU cache on the native flash-style kernel
(kernels/prefill_attention.c), instead of an SDPA call each.

SDPA on the CPU computes a chunk in fp32 over fp32 copies of its keys and values
(gathered from the pages and widened first when the chunk does not start at 0); the
kernel reads the bf16 cache where it lies, shares each key block between a tile of
queries, and multiplies bf16 queries and probabilities with the cache's bf16 keys and
values on AVX512-BF16 dot products (fp32 sums and softmax). It prefills faster than
SDPA, with logits as close to fp32's as SDPA's (docs/cpu-kernels.md,
STEP_QUERY_MAX_PAIRS; docs/benchmarks.md, Long prompts and Accuracy of the fast
modes).

Chunks short enough for the per-row queries of paged_attention.c never get here
(torch_metadata.STEP_QUERY_MAX_PAIRS); fp32 caches (the exact-parity mode) keep SDPA.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata, PrefillSlice


def prefill_kernels(flat_keys: torch.Tensor, flat_values: torch.Tensor, query: torch.Tensor):
    """The native kernels when this layer's prefill chunks can take
    prefill_attention.c: contiguous bf16 CPU caches, fp32 queries whose heads are
    contiguous per position, and a head size this build serves; else None (and
    under torch.compile, which traces SDPA but not a ctypes call)."""
    caches_fit = all(cache.dtype == torch.bfloat16 and cache.device.type == "cpu"
                     and cache.is_contiguous() for cache in (flat_keys, flat_values))
    query_fits = (query.dtype == torch.float32 and query.stride(2) == 1
                  and query.stride(1) == query.shape[2])
    if torch.compiler.is_compiling() or not (caches_fit and query_fits):
        return None
    from ..kernels import default_kernels
    kernels = default_kernels()
    if kernels is None or not kernels.library.prefill_attention_apply(query.shape[2]):
        return None
    return kernels


def attend_chunk(kernels, query: torch.Tensor, flat_keys: torch.Tensor,
                 flat_values: torch.Tensor, chunk: PrefillSlice, meta: AttentionMetadata,
                 scale: float, output: torch.Tensor) -> None:
    """output[chunk rows] = the chunk's causal attention over the cache (already
    written). query, output [T, H, D] fp32 (output contiguous); flat_keys, flat_values
    [slots, KVH, D] bf16. The context: chunk.kv_slots, whose last slot holds the
    chunk's last position, or, when None, the chunk's own slots (it starts at 0).
    Worked example: a chunk at positions 300..363 under a 256-token window has
    kv_slots for positions 45..363 (319 slots), so first_key = 364 - 319 = 45."""
    num_tokens = chunk.q_end - chunk.q_start
    end = chunk.start + num_tokens
    if chunk.kv_slots is None and chunk.start != 0:
        raise ValueError("a prefill chunk past position 0 needs its context's kv_slots")
    slots = chunk.kv_slots if chunk.kv_slots is not None \
        else meta.slot_mapping[chunk.q_start:chunk.q_end]
    slots = slots.contiguous()
    heads, dim = query.shape[1], query.shape[2]
    first_query = query[chunk.q_start]
    status = kernels.library.prefill_attention_bf16(
        first_query.data_ptr(), query.stride(0), flat_keys.data_ptr(), flat_values.data_ptr(),
        slots.data_ptr(), slots.shape[0], flat_keys.shape[0], end - slots.shape[0],
        chunk.start, num_tokens, heads, flat_keys.shape[1], dim, meta.window or 0, scale,
        output[chunk.q_start].data_ptr(), output.stride(0), kernels.num_threads)
    if status:
        reason = {3: "a query outside its context", 4: "a context slot outside the cache"}
        raise RuntimeError(f"prefill_attention_bf16 failed ({status}: "
                           f"{reason.get(status, 'shapes or memory')})")

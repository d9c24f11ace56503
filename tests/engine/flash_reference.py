"""A plain-torch implementation of the contract of flash-attn's two paged entry points
(`flash_attn_varlen_func` with `block_table`, `flash_attn_with_kvcache`), so the flash
backend's plumbing (block tables, cumulative lengths, causal alignment, windows, the
decode fast path) runs and is checked where flash-attn cannot: on CPU. It enforces
the argument rules flash-attn has (int32 tables and lengths, pages of a multiple of
256, tables wide enough) but also accepts fp32, so CPU tests keep exact parity. The
GPU tests compare it with the real kernels.
"""

from __future__ import annotations

import torch

from engine.attention.flash_backend import PAGE_MULTIPLE, FlashFunctions


def _check_paged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, "paged [N, page, KVH, D] caches"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.shape[1] % PAGE_MULTIPLE == 0, "page_block_size must be a multiple of 256"
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2


def _context(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Keys (or values) 0..length-1 of one sequence: [length, KVH, D]."""
    page = cache.shape[1]
    assert table_row.numel() * page >= length, "block table too narrow for the sequence"
    return cache[table_row.long()].reshape(-1, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            window: tuple[int, int]) -> torch.Tensor:
    """q [n, H, D] over k, v [L, KVH, D]: causal aligned bottom-right (query i at
    position L - n + i), window (left, right) around it; fully masked rows give 0."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    query_pos = torch.arange(n)[:, None] + length - n                  # [n, 1]
    key_pos = torch.arange(length)[None, :]                            # [1, L]
    allowed = torch.ones(n, length, dtype=torch.bool)
    if causal:
        allowed &= key_pos <= query_pos
    if window[0] >= 0:
        allowed &= key_pos >= query_pos - window[0]
    if window[1] >= 0:
        allowed &= key_pos <= query_pos + window[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    return torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)


def varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           softmax_scale=None, causal=False, window_size=(-1, -1), block_table=None):
    _check_paged(k_cache, v_cache, block_table)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for r in range(len(starts_q) - 1):
        n, length = starts_q[r + 1] - starts_q[r], starts_k[r + 1] - starts_k[r]
        assert n <= max_seqlen_q and length <= max_seqlen_k
        keys = _context(k_cache, block_table[r], length)
        values = _context(v_cache, block_table[r], length)
        out[starts_q[r]:starts_q[r + 1]] = _attend(q[starts_q[r]:starts_q[r + 1]], keys,
                                                   values, scale, causal, tuple(window_size))
    return out


def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1)):
    _check_paged(k_cache, v_cache, block_table)
    assert q.dim() == 4 and cache_seqlens.dtype == torch.int32
    assert block_table.shape[0] == q.shape[0] == cache_seqlens.shape[0]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for b, length in enumerate(cache_seqlens.tolist()):
        out[b] = _attend(q[b], _context(k_cache, block_table[b], length),
                         _context(v_cache, block_table[b], length), scale, causal,
                         tuple(window_size))
    return out


class CountingFunctions:
    """The reference functions, counting the calls of each entry point."""

    def __init__(self) -> None:
        self.calls = {"varlen": 0, "with_kvcache": 0}

    def functions(self) -> FlashFunctions:
        def counted(name, function):
            def call(*args, **kwargs):
                self.calls[name] += 1
                return function(*args, **kwargs)
            return call
        return FlashFunctions(counted("varlen", varlen), counted("with_kvcache", with_kvcache))

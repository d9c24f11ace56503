"""The C allocator's retention, capped at start.

glibc gives each thread that contends for the heap an arena of its own (up to eight
per core) and keeps what is freed there for reuse. The server's threads (the event
loop, the engine, the grammar-mask helper, tokenizer workers) allocate and free
tensors of changing sizes every step, so retained memory grows under load beside the
KV cache. Two arenas held 80-90 MB less after 3 minutes at 64 streams, at the same
token rate (docs/benchmarks.md, "Memory over a soak").
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8
"""mallopt's parameter number for the arena cap (glibc's malloc.h)."""


def cap_malloc_arenas(count: int | None) -> bool:
    """Cap glibc's malloc arenas at `count` (None: leave glibc's default). Returns
    whether the cap took effect (False on a libc without mallopt, e.g. musl)."""
    if count is None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if libc.mallopt(M_ARENA_MAX, count) != 1:
        logger.warning("mallopt(M_ARENA_MAX, %d) failed: arenas not capped", count)
        return False
    return True

"""The C allocator's retention: arenas capped at start, free pages handed back while
serving.

glibc gives each thread that contends for the heap an arena of its own (up to eight
per core) and keeps what is freed there for reuse. The server's threads (the event
loop, the engine, the grammar-mask helper, tokenizer workers) allocate and free
tensors of changing sizes every step, so retained memory grows under load beside the
KV cache. Two arenas hold less at the same token rate; `malloc_trim` every few
seconds returns the free pages inside the arenas too (glibc releases whole free pages
anywhere in a heap, not only at its top), which is what bounds resident memory over a
long soak (docs/benchmarks.md, Memory over a soak, has both).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8
"""mallopt's parameter number for the arena cap (glibc's malloc.h)."""


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:             # not glibc (musl, macOS): nothing to tune
        return None


def cap_malloc_arenas(count: int | None) -> bool:
    """Cap glibc's malloc arenas at `count` (None: leave glibc's default). Returns
    whether the cap took effect (False on a libc without mallopt, e.g. musl)."""
    libc = _libc() if count is not None else None
    if libc is None:
        return False
    if libc.mallopt(M_ARENA_MAX, count) != 1:
        logger.warning("mallopt(M_ARENA_MAX, %d) failed: arenas not capped", count)
        return False
    return True


class AllocatorTrimmer:
    """Calls glibc's `malloc_trim(0)` every `interval_s` seconds (0: never) on a
    worker thread (it takes each arena's lock in turn, so the event loop never waits
    on it)."""

    def __init__(self, interval_s: float) -> None:
        libc = _libc() if interval_s > 0 else None
        self.trim = None if libc is None else libc.malloc_trim
        self.interval_s = interval_s
        self.count = 0
        self.longest_s = 0.0
        """The longest single trim so far (reported by `stats`)."""
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.trim is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def trim_once(self) -> bool:
        """One trim; True when it released memory."""
        started = time.perf_counter()
        released = bool(self.trim(0))
        self.longest_s = max(self.longest_s, time.perf_counter() - started)
        self.count += 1
        return released

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.trim_once)

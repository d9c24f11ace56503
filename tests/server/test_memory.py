"""The malloc arena cap: applied through glibc's mallopt, skipped when unset."""

import ctypes.util

import pytest

from server.memory import cap_malloc_arenas


def test_no_cap_is_asked_for_without_a_count():
    assert cap_malloc_arenas(None) is False


@pytest.mark.skipif("glibc" not in (ctypes.util.find_library("c") or "") and
                    ctypes.util.find_library("c") != "libc.so.6",
                    reason="mallopt is glibc's")
def test_the_cap_takes_effect_on_glibc():
    assert cap_malloc_arenas(2) is True


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_the_trimmer_runs_on_its_interval_and_stops():
    import asyncio

    from server.memory import AllocatorTrimmer

    async def main():
        trimmer = AllocatorTrimmer(0.05)
        if trimmer.trim is None:
            pytest.skip("malloc_trim is glibc's")
        trimmer.start()
        await asyncio.sleep(0.4)
        await trimmer.stop()
        stopped_at = trimmer.count
        await asyncio.sleep(0.2)
        return stopped_at, trimmer.count

    stopped_at, later = asyncio.run(main())
    assert stopped_at >= 3 and later == stopped_at


def test_an_interval_of_zero_never_trims():
    from server.memory import AllocatorTrimmer

    trimmer = AllocatorTrimmer(0)
    assert trimmer.trim is None

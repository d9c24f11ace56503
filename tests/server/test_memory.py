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

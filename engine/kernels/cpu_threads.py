"""Keeping torch's CPU helper threads awake for the engine thread.

torch runs its CPU ops on OpenMP (libgomp in the PyPI wheels). libgomp gives every
thread that runs a parallel op a pool of helper threads of its own. While the
process holds no more helpers than there are CPUs, a helper spins for a few
milliseconds after each op, ready for the next; once it holds more, libgomp
"throttles" them: they spin ~100 times and then sleep, and every later op pays to
wake them. Loading a model on the main thread leaves the main thread's pool behind,
so the engine thread, the second pool, runs throttled: each of a decode step's
~1,500 ops pays for a wake-up, and small ops cost many times their own work.

`release_openmp_pool()` frees the calling thread's pool (OpenMP 5.0's
`omp_pause_resource_all`, which libgomp implements as "free this thread's pool").
`load_model` calls it on the loading thread when done, the manager on the thread
that starts the engine (right before the engine thread starts) and after a warm-up.
A later large op on another thread builds a new pool, slowing the engine again
(never changing its results); the server's event loop runs none.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
_gomp: ctypes.CDLL | None | bool = False     # False: not looked up yet


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already loaded (torch's first, if several are), or
    None (other platforms, other OpenMP runtimes)."""
    global _gomp
    if _gomp is not False:
        return _gomp
    _gomp = None
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libgomp" in line}
        except OSError:
            paths = set()
        for path in sorted(paths, key=lambda p: ("/torch/" not in p, p)):
            try:
                library = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(library, "GOMP_parallel"):
                _gomp = library
                break
    return _gomp


def openmp_entry_points() -> tuple[int, int, int] | None:
    """Addresses of GOMP_parallel, omp_get_thread_num and omp_get_num_threads in
    torch's libgomp, for native code to run on the same thread teams as torch's ops
    (engine/kernels/worker_pool.h); None without a libgomp."""
    import torch  # noqa: F401

    library = _loaded_libgomp()
    if library is None:
        return None
    try:
        functions = (library.GOMP_parallel, library.omp_get_thread_num,
                     library.omp_get_num_threads)
    except AttributeError:
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in functions)


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP helper threads; True if there was a libgomp
    to ask and it agreed. Call it outside any torch op (it refuses inside one)."""
    import torch  # noqa: F401  (libgomp is loaded with torch)

    library = _loaded_libgomp()
    if library is None or not hasattr(library, "omp_pause_resource_all"):
        return False
    library.omp_pause_resource_all.argtypes = [ctypes.c_int]
    library.omp_pause_resource_all.restype = ctypes.c_int
    released = library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    logger.debug("OpenMP pool of this thread %s", "released" if released else "kept")
    return released

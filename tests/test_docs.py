"""The docs point at things that exist: README.md and docs/*.md.

Paths. Checked, in every page:
- every markdown link and image, `[text](target)` and `![alt](target)`, whose target
  is relative (not http(s)://, mailto:, an anchor alone, or an absolute path); the
  anchor is dropped and the target is resolved from the page's own folder;
- every word inside backticks that looks like a repository file: made only of
  letters, digits and `_ . - / * { } ,` (so not `org/name:FILE.gguf`, `VAR=value` or a
  URL), not starting with `/`, `~`, `$`, `-` or `.` (absolute, home and cache
  paths), and either ending in .py, .md, .yaml, .json, .png or .sh, or holding a `/`
  after a first part that names a top-level entry of the repository or of engine/,
  server/, bench/ or tests/ (so `kernels/block_gemm.c` is checked, `application/json`
  and `org/name` are not). A word with a `/` resolves from the repository root, the
  page's folder, or engine/, server/, bench/ or tests/ (the pages name engine files
  as `kernels/block_gemm.c`); a bare file name (`native.py`) must be the name of some
  file in the repository. `{a,b}` expands to each name, all of which must exist; `*`
  must match at least one file. Folders the tools create at run time (RUNTIME_PATHS)
  are skipped.

Flags. Every `--flag` README.md names must be one of the server's options
(server/cli.py `build_parser()`), unless it belongs to another program. A flag
belongs to the last program named before it in the same unit: a paragraph, a list
item or a table row of prose, or one command line of a code block (a line ending in
a backslash continues on the next). `python -m server`, `-m server` and `make
serve` name the server; `bench.*` and `bench/*` tools, `make`, `pip`, `pytest`,
`docker`, `curl`, `torchrun` and `llama-server` name others. A flag with no program
before it in its unit is the server's (the README's prose lists them).
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import itertools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEARCH_FOLDERS = ["", "engine", "server", "bench", "tests"]
PATH_SUFFIXES = (".py", ".md", ".yaml", ".json", ".png", ".sh")
RUNTIME_PATHS = {"gpu-carry", "gpu-results"}
"""Folders made by bench/gpu_carry.sh and bench/gpu_check.sh (git-ignored)."""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
FENCE = re.compile(r"^\s*(```|~~~)")
PATH_WORD = re.compile(r"^[A-Za-z0-9_.\-/*{},]+$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SERVER = re.compile(r"python -m server\b|(?<![\w.])-m server\b|\bmake serve\b")
OTHER = re.compile(r"\bbench(?:\.\w+|/)|\bmake\b(?! serve)|\bpip\b|\bpytest\b|\bdocker\b"
                   r"|\bcurl\b|\btorchrun\b|\bllama-server\b")


def _expand(word: str) -> list[str]:
    """`a-{1,2}.json` -> [`a-1.json`, `a-2.json`]."""
    parts = re.split(r"\{([^{}]*)\}", word)
    options = [parts[i].split(",") if i % 2 else [parts[i]] for i in range(len(parts))]
    return ["".join(choice) for choice in itertools.product(*options)]


@functools.cache
def _top_level_names() -> set[str]:
    return {entry.name for folder in SEARCH_FOLDERS for entry in (ROOT / folder).iterdir()}


@functools.cache
def _file_names() -> set[str]:
    names = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders
                         if not name.startswith(".") and name not in ("__pycache__", "build")]
        names.update(files)
    return names


def _exists(name: str, page: Path) -> bool:
    if "/" not in name:
        return any(fnmatch.fnmatch(known, name) for known in _file_names())
    folders = [page.parent] + [ROOT / folder for folder in SEARCH_FOLDERS]
    for folder in folders:
        candidate = str(folder / name)
        if glob.has_magic(name) and glob.glob(candidate):
            return True
        if not glob.has_magic(name) and Path(candidate).exists():
            return True
    return False


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def link_targets(page: Path) -> list[str]:
    """The page's relative link targets, anchors dropped."""
    targets = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def path_words(page: Path) -> list[str]:
    """Words in backticks that look like repository paths (see the module's rule)."""
    words = []
    for _, span in CODE_SPAN.findall(_prose(page.read_text())):
        for word in span.split():
            if word.startswith(("/", "~", "$", "-", ".")):
                continue
            word = word.strip("()[]'\"").rstrip(".,;:").rstrip("/")
            if not PATH_WORD.match(word):
                continue
            if word.endswith(PATH_SUFFIXES) or (
                    "/" in word and word.split("/")[0] in _top_level_names()):
                words.append(word)
    return words


def missing_paths(page: Path) -> list[str]:
    missing = []
    for target in link_targets(page):
        if target and not (page.parent / target).exists():
            missing.append(f"link ({target})")
    for word in path_words(page):
        if word.split("/")[0] in RUNTIME_PATHS:
            continue
        for name in _expand(word):
            if not _exists(name, page):
                missing.append(f"`{word}`" + (f" ({name})" if name != word else ""))
    return missing


def _units(text: str) -> list[str]:
    """Paragraphs, list items and table rows of prose; command lines of code blocks."""
    units, current, fenced, command = [], [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            units.append("\n".join(current))
            current = []
            continue
        if fenced:
            command += line.rstrip("\\") + " "
            if not line.rstrip().endswith("\\"):
                units.append(command)
                command = ""
            continue
        starts_unit = (not line.strip() or line.lstrip().startswith("|")
                       or re.match(r"\s*([-*]|\d+\.)\s", line))
        if starts_unit:
            units.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
    units.append("\n".join(current))
    return units


def server_flags(text: str) -> list[str]:
    """The flags that belong to the server (see the module's rule)."""
    flags = []
    for unit in _units(text):
        marks = [(m.start(), True) for m in SERVER.finditer(unit)]
        marks += [(m.start(), False) for m in OTHER.finditer(unit)]
        for flag in FLAG.finditer(unit):
            before = [is_server for start, is_server in sorted(marks) if start < flag.start()]
            if not before or before[-1]:
                flags.append(flag.group())
    return flags


def server_options() -> set[str]:
    from server.cli import build_parser

    return {option for action in build_parser()._actions for option in action.option_strings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_paths_in_docs_exist(page):
    assert missing_paths(page) == []


def test_readme_flags_are_server_options():
    options = server_options()
    unknown = sorted({flag for flag in server_flags((ROOT / "README.md").read_text())
                      if flag not in options})
    assert unknown == []


def test_the_checks_can_fail(tmp_path):
    """A broken link, a missing path and a flag the server lacks are each caught."""
    page = tmp_path / "page.md"
    page.write_text("See [the guide](docs/missing.md) and `engine/nowhere.py`, "
                    "`docs/bench/{soak-trim-10min,absent}.json`; ![x](bench/gone.png)\n\n"
                    "`python -m server --no-such-flag`; `python -m bench.serve --concurrency 8`\n")
    missing = missing_paths(page)
    assert "link (docs/missing.md)" in missing and "link (bench/gone.png)" in missing
    assert "`engine/nowhere.py`" in missing
    assert any("absent.json" in entry for entry in missing)
    assert not any("soak-trim-10min.json" in entry for entry in missing)
    flags = server_flags(page.read_text())
    assert flags == ["--no-such-flag"]

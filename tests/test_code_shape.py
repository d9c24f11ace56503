"""The house's shape rules that a reader meets first (docs/architecture.md): no
function in engine/ or server/ runs over 60 lines, counted from its `def` to its
last line, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def long_functions(root: Path, packages=("engine", "server")) -> list[tuple[str, str, int]]:
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append((str(path.relative_to(root)), node.name, lines))
    return found


def test_no_function_runs_over_60_lines():
    assert long_functions(ROOT) == []


def test_the_count_sees_a_long_method(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "server").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "engine" / "a.py").write_text(f"class A:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path) == [("engine/a.py", "long", 61)]

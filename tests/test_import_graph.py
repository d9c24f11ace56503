"""The house's imports run one way (docs/architecture.md): no circles among the
project's modules, counting imports inside functions too (a circle closed by a lazy
import is a circle all the same: the parts cannot be read or tested apart); `engine`
never imports `server` or `bench`; the scheduling code imports no torch; pydantic is
never imported in `engine` (validation at the edge is the server's)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "bench")
SCHEDULER = "engine.core.scheduler"
"""Its own code and every project module it reaches make up the scheduling code."""
LOOP_FOLDERS = ("core", "step", "speculative", "encoder")
"""engine/'s folders that run requests (docs/architecture.md's map)."""
PART_FOLDERS = ("attention", "distributed", "kernels", "loading", "models", "structured")
"""engine/'s folders a model and its load are made of: they never reach up into the
loop that runs requests."""


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement of the module reaches, resolved."""
    names = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return {module: {name for name in imported_names(module, path)
                     if name in files and name != module}
            for module, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step), on_stack.add(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return found


def test_no_import_circles():
    assert circles(import_graph(module_files())) == []


def test_engine_imports_neither_server_nor_bench():
    files = module_files()
    upward = {module: sorted(name for name in imported_names(module, path)
                             if name.split(".")[0] in ("server", "bench"))
              for module, path in files.items() if module.split(".")[0] == "engine"}
    assert {module: names for module, names in upward.items() if names} == {}


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_scheduling_code_imports_no_torch_and_engine_no_pydantic():
    files = module_files()
    scheduling = reached(import_graph(files), SCHEDULER)
    assert {"engine.core.requests", "engine.kv_cache.block_manager",
            "engine.speculative.proposer"} <= scheduling
    for module in scheduling:
        assert "torch" not in {name.split(".")[0] for name in
                               imported_names(module, files[module])}, module
    for module, path in files.items():
        if module.split(".")[0] == "engine":     # bench is a client: it may model bodies
            assert "pydantic" not in {name.split(".")[0]
                                      for name in imported_names(module, path)}, module


def engine_folder(module: str, path: Path) -> str | None:
    """engine/'s folder a module lives in (None at engine/'s top level)."""
    parts = module.split(".")
    inside = len(parts) > 2 or (len(parts) == 2 and path.name == "__init__.py")
    return parts[1] if parts[0] == "engine" and inside else None


def test_engine_top_level_is_the_public_face_and_parts_never_import_the_loop():
    files = module_files()
    top = sorted(module for module, path in files.items()
                 if module.startswith("engine") and engine_folder(module, path) is None)
    assert len(top) <= 10, top
    graph = import_graph(files)
    upward = [(module, name) for module, path in files.items()
              if engine_folder(module, path) in PART_FOLDERS
              for name in graph[module] if engine_folder(name, files[name]) in LOOP_FOLDERS]
    assert upward == []


def test_the_circle_check_finds_a_circle_closed_inside_a_function(tmp_path):
    (tmp_path / "engine").mkdir()
    for package in ("server", "bench"):
        (tmp_path / package).mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from .b import thing\n")
    (tmp_path / "engine" / "b.py").write_text("def thing():\n    from . import a\n")
    (tmp_path / "engine" / "c.py").write_text("from .a import x\n")
    assert circles(import_graph(module_files(tmp_path))) == [["engine.a", "engine.b"]]

"""The scheduler's modules import each other without a cycle, counting imports inside functions.

A cycle hidden in a function-level import still ties two modules together (the daemon used to
fork supervisors that imported the daemon back to wake it); clients talk to the daemon through
`scheduler.control` instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

SCHEDULER = Path(__file__).resolve().parents[1] / "scheduler"


def _runtime_nodes(tree: ast.AST):
    """Every node, except under `if TYPE_CHECKING:` (those imports never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imported(tree: ast.AST, package: str) -> set[str]:
    """The modules of `package` a module imports, at any depth (module level and inside functions)."""
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == package}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package:  # from scheduler import procs, store
                out |= {f"{package}.{a.name}" for a in node.names}
            elif node.module.split(".")[0] == package:
                out.add(node.module)
    return out


def import_graph(folder: Path = SCHEDULER) -> dict[str, set[str]]:
    package = folder.name
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {name: _imported(ast.parse(path.read_text()), package) & set(modules) - {name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        path = path + [node]
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_find_cycle_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "scheduler"
    pkg.mkdir()
    (pkg / "a.py").write_text("from scheduler import b\n")
    (pkg / "b.py").write_text("def f():\n    from scheduler.a import x\n")
    (pkg / "c.py").write_text("import scheduler.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scheduler import c\n")
    graph = import_graph(pkg)
    assert graph == {"scheduler.a": {"scheduler.b"}, "scheduler.b": {"scheduler.a"},
                     "scheduler.c": {"scheduler.a"}, "scheduler.d": set()}
    assert find_cycle(graph) == ["scheduler.a", "scheduler.b", "scheduler.a"]
    (pkg / "b.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg)) is None


def test_no_import_cycle_among_scheduler_modules():
    graph = import_graph()
    assert "scheduler.daemon" in graph and "scheduler.supervisor" in graph
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_daemon_clients_use_control_not_the_daemon_loop():
    graph = import_graph()
    importers = sorted(m for m, deps in graph.items() if "scheduler.daemon" in deps)
    assert importers == ["scheduler.cli"]  # `python -m scheduler daemon` runs the loop
    assert "scheduler.control" in graph["scheduler.supervisor"]

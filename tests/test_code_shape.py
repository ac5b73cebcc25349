"""The code's shape, checked: short functions outside tests and migrations, and no file that
points a reader at notes that are not in the repository."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

MAX_FUNCTION_LINES = 80
SOURCES = ["app.py", "sae_dist", "scheduler", "pages", "webui", "scripts"]


def python_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = REPO / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if "migrations" not in f.parts]


def test_no_function_is_over_80_lines():
    long = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these into named pieces:\n" + "\n".join(long)


def test_nothing_cites_notes_outside_the_repository():
    texts = [*python_files(), *sorted((REPO / "tests").glob("*.py")), *sorted((REPO / "docs").glob("*.md")),
             REPO / "README.md", REPO / "pyproject.toml", REPO / ".streamlit" / "config.toml",
             *sorted((REPO / "scripts").glob("*.sh"))]
    citing = [str(p.relative_to(REPO)) for p in texts
              if p.name != "test_code_shape.py" and any(w in p.read_text() for w in ("DESIGN.md", "shared/notes"))]
    assert not citing, f"these cite notes a reader of the repository cannot open: {citing}"


def _package_imports() -> dict[str, set[str]]:
    """sae_dist's parts (a subpackage, or a top-level module) -> the parts each imports, at any
    depth (module level and inside functions), TYPE_CHECKING blocks included."""
    root = REPO / "sae_dist"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        rel = path.relative_to(root).with_suffix("").parts
        part = rel[0] if rel[0] != "__init__" else "sae_dist"
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                bits = name.split(".")
                if (bits[0] == "sae_dist" and len(bits) > 1
                        and (root / bits[1]).exists() | (root / f"{bits[1]}.py").exists()):
                    if bits[1] != part:
                        graph.setdefault(part, set()).add(bits[1])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_parts_of_sae_dist_import_each_other_one_way():
    """Between two parts of sae_dist (a subpackage or a module) the arrow goes one way: no cycle."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
    graph = _package_imports()
    assert graph["train"] and "scheduler" not in graph
    assert _cycle(graph) is None, f"an import cycle between parts of sae_dist: {' -> '.join(_cycle(graph))}"


def bare_expressions(source: str) -> list[int]:
    """Lines of statements that are a value alone, neither a call nor a string (Streamlit's magic
    leaves strings alone by default): what magic would draw, and what draws nothing with it off."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Expr)
                  and not isinstance(node.value, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom))
                  and not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)))


def test_pages_draw_by_calls_only_as_the_config_turns_magic_off():
    import tomllib

    assert tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())["runner"]["magicEnabled"] is False
    assert bare_expressions('"""doc"""\ndef f():\n    """doc"""\n    x\nst.write(1)\ndf\n') == [4, 6]
    pages = [REPO / "app.py", *sorted((REPO / "pages").glob("*.py"))]
    drawn_by_magic = [f"{p.relative_to(REPO)}:{line}" for p in pages for line in bare_expressions(p.read_text())]
    assert not drawn_by_magic, f"write these with st.write (magic is off): {drawn_by_magic}"

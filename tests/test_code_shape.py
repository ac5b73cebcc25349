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

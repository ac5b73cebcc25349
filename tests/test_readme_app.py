"""docs/app.md's Pages section states each page's refresh interval: the code's, not a guess."""

from __future__ import annotations

import ast
import re

from conftest import REPO


def constant(path: str, name: str) -> int:
    for node in ast.parse((REPO / path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def bullet(page: str) -> str:
    app = (REPO / "docs" / "app.md").read_text().split("\n## Pages", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^- \*\*{re.escape(page)}:\*\*(.*?)(?=^- \*\*|^\S|\Z)", app, re.S | re.M)
    assert match, page
    return " ".join(match.group(1).split())


def test_the_readme_refresh_intervals_are_the_codes():
    shared = constant("webui/sidebar.py", "REFRESH_SECONDS")
    intervals = {"Overview": shared, "Training runs": shared,
                 "Monitor": constant("pages/2_Monitor.py", "REFRESH_S"),
                 "Queue": constant("pages/3_Queue.py", "REFRESH_S")}
    for page, seconds in intervals.items():
        said = re.findall(r"[Rr]edraws?(?: itself)? every (\d+) s", bullet(page))
        assert said == [str(seconds)], (page, said, seconds)

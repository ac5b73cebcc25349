"""Whether the check fits the device tool's limits: what travels (the working tree git does not
ignore, plus the carried wheels) and what comes back from $OUT.

    python3 scripts/gpu_check/travel.py --carry .whl --out DIR

Exit 1, naming what is over, when either does not fit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MIB = 2**20
TRAVEL_LIMIT = 64 * MIB  # the working tree and the carried paths, together
BACK_FILES = 8  # files that come back from $OUT
BACK_FILE_LIMIT = 16 * MIB  # each
BACK_LIMIT = 64 * MIB  # together


def travel_problems(tree_bytes: int, carried_bytes: int) -> list[str]:
    total = tree_bytes + carried_bytes
    if total <= TRAVEL_LIMIT:
        return []
    return [f"{total / MIB:.1f} MiB would travel (tree {tree_bytes / MIB:.1f} + carried {carried_bytes / MIB:.1f}), "
            f"over {TRAVEL_LIMIT / MIB:.0f} MiB"]


def back_problems(files: dict[str, int]) -> list[str]:
    """`files`: each path under $OUT, relative, with its size."""
    problems = []
    if len(files) > BACK_FILES:
        problems.append(f"{len(files)} files in OUT, at most {BACK_FILES} come back")
    problems += [f"{name}: {size / MIB:.1f} MiB, over {BACK_FILE_LIMIT / MIB:.0f} MiB a file"
                 for name, size in files.items() if size > BACK_FILE_LIMIT]
    problems += [f"{name}: more than 2 folders down" for name in files if name.count("/") > 2]
    if sum(files.values()) > BACK_LIMIT:
        problems.append(f"{sum(files.values()) / MIB:.1f} MiB in OUT, over {BACK_LIMIT / MIB:.0f} MiB")
    return problems


def tree_bytes(repo: Path) -> int:
    """Tracked files and untracked ones git does not ignore: what the device tool sends."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((repo / name.decode()).stat().st_size for name in listed if name and (repo / name.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--carry", action="append", default=[], help="a carried path (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args()
    repo = Path(__file__).resolve().parents[2]
    tree, carried = tree_bytes(repo), sum(folder_bytes(repo / c) for c in ns.carry)
    back = {str(f.relative_to(ns.out)): f.stat().st_size for f in ns.out.rglob("*") if f.is_file()}
    problems = travel_problems(tree, carried) + back_problems(back)
    print(f"travels: {(tree + carried) / MIB:.1f} MiB (tree {tree / MIB:.1f}, carried {carried / MIB:.1f}; limit "
          f"{TRAVEL_LIMIT / MIB:.0f}); comes back: {len(back)} files, {sum(back.values()) / MIB:.2f} MiB "
          f"(limit {BACK_FILES} files)")
    for problem in problems:
        print(f"over the device's limits: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

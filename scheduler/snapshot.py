"""`submit --snapshot`: the job runs the git checkout as it was when it was queued.

At submit the checkout's files as they are on disk (the commit plus every uncommitted change and
every new file git does not ignore) are written to a tree object through a throwaway index (the
user's index and working tree are never touched) and exported with `git archive` into
`$SAE_DIST_HOME/snapshots/<name>/checkout`. The job's row names the commit (`<sha>` or
`<sha>+uncommitted`) and the copy of its working directory. A command job runs in that copy; a
training job (its settings were stored at submit) runs where it was submitted; both import
Python from the copy first (PYTHONPATH), so `python train.py` and `python -m pkg` run the queued code.

A snapshot is removed once no pending or running job names it, unless a job wrote into it (a
result must never be lost): then it is kept, with `KEPT` saying what changed. Decisions are the
pure functions at the top; git and the file system are at the bottom.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from filelock import FileLock, Timeout

from sae_dist.errors import UserError
from sae_dist.paths import state_home

log = logging.getLogger(__name__)

FLAG = "--snapshot"
CHECKOUT = "checkout"  # the files, under the snapshot's folder
RECORD = "snapshot.json"  # commit, tree, when, and the manifest the copy is checked against
KEPT = "KEPT"  # a job changed the copy: kept, and this file says what changed
UNCOMMITTED = "+uncommitted"
SNAPSHOT_ENV = "SAE_DIST_SNAPSHOT"  # the job's copy of the checkout
SUBMIT_DIR_ENV = "SAE_DIST_SUBMIT_DIR"  # where it was submitted (SLURM_SUBMIT_DIR's meaning)
_IGNORED_DIRS = frozenset({"__pycache__"})  # Python's bytecode cache, written by running the copy


@dataclass(frozen=True)
class Snapshot:
    commit: str  # HEAD's sha, with "+uncommitted" when the files differ from it
    root: str  # the copy of the checkout
    workdir: str  # the copy of the job's working directory


# ---- decisions (pure) ----

def commit_label(head: str, tree: str, head_tree: str) -> str:
    return head if tree == head_tree else head + UNCOMMITTED


def workdir_in_copy(copy_root: str, checkout_root: str, workdir: str) -> str:
    """The job's working directory inside the copy (workdir lies in the checkout)."""
    rel = os.path.relpath(os.path.realpath(workdir), os.path.realpath(checkout_root))
    return os.path.normpath(os.path.join(copy_root, rel))


def changes(manifest: dict[str, list[int]], now: dict[str, list[int]]) -> list[str]:
    """Paths added, removed or rewritten (size or modification time) since the copy was made."""
    added = [f"+ {p}" for p in sorted(now.keys() - manifest.keys())]
    removed = [f"- {p}" for p in sorted(manifest.keys() - now.keys())]
    changed = [f"~ {p}" for p in sorted(manifest.keys() & now.keys()) if manifest[p] != now[p]]
    return added + removed + changed


# ---- taking one (git) ----

@contextlib.contextmanager
def taken(workdir: str) -> Iterator[Snapshot]:
    """A snapshot of the checkout holding `workdir`, for the caller to store a job naming it: the
    snapshots' lock is held until then (`release` skips while it is, so a copy never goes between
    being written and being named), and the copy is removed if storing it fails."""
    snapshots_home().mkdir(exist_ok=True)
    with _lock():
        snapshot = take(workdir)
        try:
            yield snapshot
        except BaseException:
            shutil.rmtree(root_of(snapshot.root), ignore_errors=True)
            raise


def take(workdir: str) -> Snapshot:
    """Copy the checkout holding `workdir` as it is now; a UserError outside a git checkout."""
    root = _git(workdir, "rev-parse", "--show-toplevel", what=f"{workdir} is not inside a git checkout")
    head = _git(root, "rev-parse", "--verify", "HEAD^{commit}", what=f"the checkout {root} has no commit yet")
    with tempfile.TemporaryDirectory(prefix="sae-dist-index-") as tmp:
        index = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}  # a throwaway index: the user's stays
        _git(root, "read-tree", "HEAD", env=index)
        _git(root, "add", "-A", env=index)  # uncommitted changes, deletions, new files not ignored
        tree = _git(root, "write-tree", env=index)
    home = snapshots_home()
    name = f"{tree[:12]}-{uuid.uuid4().hex[:8]}"
    partial = home / f".{name}.partial"
    copy = partial / CHECKOUT
    copy.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", root, "archive", "--format=tar", tree], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        tar.extractall(copy, filter="tar")  # members as git stored them; none may leave the folder
    if archive.wait() != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"{FLAG}: git archive of {root} failed (exit {archive.returncode})")
    record = {"commit": commit_label(head, tree, _git(root, "rev-parse", "HEAD^{tree}")), "tree": tree,
              "checkout": root, "created_at": time.time(), "manifest": listing(copy)}
    (partial / RECORD).write_text(json.dumps(record))
    os.rename(partial, home / name)  # whole or absent: a half copy never carries a name
    final = home / name / CHECKOUT
    return Snapshot(record["commit"], str(final), workdir_in_copy(str(final), root, workdir))


def _git(cwd: str, *args: str, what: str | None = None, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
    except FileNotFoundError:
        raise UserError(f"{FLAG}: needs git, and git is not installed") from None
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise UserError(f"{FLAG}: {what or 'git ' + args[0] + ' failed'} ({detail[0]})")
    return done.stdout.strip()


# ---- keeping and removing ----

def snapshots_home() -> Path:
    """Where snapshots live; made by the first `take` (a state directory without one has none)."""
    return state_home() / "snapshots"


def root_of(copy_dir: str) -> Path:
    """The snapshot folder (under snapshots_home) that a job's stored copy directory lies in."""
    home = snapshots_home()
    return home / Path(copy_dir).resolve().relative_to(home.resolve()).parts[0]


def listing(copy: Path) -> dict[str, list[int]]:
    """Every file and link of the copy: [size, modification time in ns], Python's caches left out."""
    out: dict[str, list[int]] = {}
    for dirpath, dirnames, filenames in os.walk(copy):
        dirnames[:] = [d for d in dirnames if d not in _IGNORED_DIRS]
        for f in filenames:
            st = os.lstat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), copy)] = [st.st_size, st.st_mtime_ns]
    return out


def _lock() -> FileLock:
    return FileLock(snapshots_home() / ".lock")


def release(referenced: Iterable[str], wait_s: float = 0.0) -> list[str]:
    """Remove every snapshot no live job names (`referenced`: the copy directories of pending and
    running jobs) unless a job changed it; the names removed. While another holds the lock (a
    submit whose copy is not named yet, another release) for more than `wait_s`, nothing is
    removed: a later call does it."""
    if not snapshots_home().is_dir():
        return []
    try:
        with _lock().acquire(timeout=wait_s):
            return _release({root_of(d).name for d in referenced})
    except Timeout:
        return []


def _release(names: set[str]) -> list[str]:
    removed = []
    for folder in sorted(p for p in snapshots_home().iterdir() if not p.name.startswith(".")):
        try:
            record = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            continue
        if (folder / KEPT).exists() or folder.name in names:
            continue
        changed = changes(record["manifest"], listing(folder / CHECKOUT))
        if changed:  # a job wrote here: its files are results, never thrown away
            (folder / KEPT).write_text("A job changed this copy, so it is kept:\n" + "\n".join(changed) + "\n")
            log.info("snapshot %s kept: a job changed %d files in it", folder, len(changed))
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder.name)
    return removed


def release_snapshots(engine, wait_s: float = 0.0) -> list[str]:
    """`release` against the database's live jobs; a database that cannot be read now (locked,
    full...) leaves every snapshot for a later call."""
    from scheduler.storage_errors import storage_problem
    from scheduler.store import live_snapshot_dirs

    try:
        referenced = live_snapshot_dirs(engine)
    except Exception as e:
        if storage_problem(e) is None:
            raise
        return []
    return release(referenced, wait_s)

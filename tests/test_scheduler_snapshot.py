"""`submit --snapshot`: a queued job runs the checkout as it was at submit, with a real git, a real
daemon and real jobs; the copy goes when the job ends, unless the job wrote into it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from sae_dist.db import get_engine
from scheduler import snapshot as S
from scheduler.store import count_jobs, get_job


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    """A checkout with a commit, an uncommitted change, a new file and an ignored one."""
    r = tmp_path / "proj"
    (r / "pkg").mkdir(parents=True)
    (r / "pkg" / "__init__.py").write_text("")
    (r / "pkg" / "version.py").write_text("VERSION = 'committed'\n")
    (r / "main.py").write_text("from pkg.version import VERSION\nprint(VERSION)\n")
    (r / ".gitignore").write_text("data/\n")
    git(r, "init", "-q")
    git(r, "add", "-A")
    git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    (r / "pkg" / "version.py").write_text("VERSION = 'at submit'\n")  # uncommitted
    (r / "new.py").write_text("print('new file')\n")  # untracked, not ignored
    (r / "data").mkdir()
    (r / "data" / "big.bin").write_bytes(b"x" * 1000)  # ignored
    return r


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, module="scheduler", timeout=60)


# ---- decisions on plain data ----

def test_commit_label_says_when_the_files_differ_from_the_commit():
    assert S.commit_label("abc", "t1", "t1") == "abc"
    assert S.commit_label("abc", "t2", "t1") == "abc+uncommitted"


def test_workdir_in_copy_keeps_the_place_inside_the_checkout(tmp_path):
    assert S.workdir_in_copy("/s/checkout", str(tmp_path), str(tmp_path / "a" / "b")) == "/s/checkout/a/b"
    assert S.workdir_in_copy("/s/checkout", str(tmp_path), str(tmp_path)) == "/s/checkout"


def test_changes_name_added_removed_and_rewritten_files():
    before = {"a": [1, 10], "b": [2, 20], "c": [3, 30]}
    after = {"a": [1, 10], "b": [2, 21], "d": [4, 40]}
    assert S.changes(before, after) == ["+ d", "- c", "~ b"]
    assert S.changes(before, dict(before)) == []


# ---- taking one, with git ----

def test_a_snapshot_holds_the_files_as_they_are_and_leaves_the_users_index_alone(repo):
    status_before = git(repo, "status", "--porcelain")
    with S.taken(str(repo / "pkg")) as snap:
        copy = Path(snap.root)
        assert (copy / "pkg" / "version.py").read_text() == "VERSION = 'at submit'\n"
        assert (copy / "new.py").exists() and not (copy / "data").exists()  # new files in, ignored out
        assert snap.workdir == str(copy / "pkg")
        head = git(repo, "rev-parse", "HEAD").strip()
        assert snap.commit == head + "+uncommitted"
    assert git(repo, "status", "--porcelain") == status_before  # nothing staged, nothing changed
    git(repo, "stash", "-u", "-q")  # a clean checkout: the label is the commit alone
    with S.taken(str(repo)) as clean:
        assert clean.commit == head


def test_a_failed_submit_removes_its_copy(repo):
    with pytest.raises(RuntimeError), S.taken(str(repo)) as snap:
        raise RuntimeError("the row could not be stored")
    assert not Path(snap.root).exists()
    assert [p.name for p in S.snapshots_home().iterdir() if not p.name.startswith(".")] == []


def test_release_keeps_what_a_live_job_names_and_what_a_job_wrote_into(repo):
    copies = []
    for _ in range(3):
        with S.taken(str(repo)) as snap:
            copies.append(snap)
    live, written, idle = copies
    (Path(written.root) / "results.txt").write_text("a result")
    (Path(idle.root) / "pkg" / "__pycache__").mkdir()  # running Python in a copy writes these
    (Path(idle.root) / "pkg" / "__pycache__" / "version.cpython-311.pyc").write_bytes(b"\0")
    removed = S.release([live.workdir])
    assert removed == [S.root_of(idle.root).name]
    assert Path(live.root).exists()
    kept = S.root_of(written.root)
    assert "+ results.txt" in (kept / S.KEPT).read_text()
    assert S.release([]) == [S.root_of(live.root).name]  # its job ended; the kept one stays
    assert (kept / S.CHECKOUT / "results.txt").exists()


# ---- bad input: one line, exit 2, nothing stored ----

def test_snapshot_outside_a_checkout_or_before_a_commit_is_refused(tmp_path, state_home):
    empty = tmp_path / "not-a-checkout"
    empty.mkdir()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    git(fresh, "init", "-q")
    for where, says in ((empty, "is not inside a git checkout"), (fresh, "has no commit yet")):
        r = cli("submit", "--snapshot", "-D", str(where), "--gpus", "0", "--", "true")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "--snapshot" in r.stderr and says in r.stderr
    r = cli("submit", "--snapshot", "--cluster", "slurm", "--", "true")
    assert r.returncode == 2 and "--snapshot" in r.stderr, r.stderr
    assert not (state_home / "snapshots").exists() or not [
        p for p in (state_home / "snapshots").iterdir() if not p.name.startswith(".")]
    if (state_home / "state.db").exists():
        assert count_jobs(get_engine()) == 0


# ---- a real daemon ----

@pytest.mark.slow
def test_a_queued_job_runs_the_code_as_it_was_at_submit(repo, tmp_path, monkeypatch, state_home):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "1")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    out = tmp_path / "out"
    out.mkdir()
    r = cli("submit", "--json", "--snapshot", "-H", "-D", str(repo), "--gpus", "0", "-o", str(out / "plain.out"),
            "--", sys.executable, "main.py")
    plain = json.loads(r.stdout)
    writer = json.loads(cli("submit", "--json", "--snapshot", "-H", "-D", str(repo), "--gpus", "0",
                            "-o", str(out / "writer.out"), "--", sys.executable, "-c",
                            "import os, pkg.version as v; open('result.txt', 'w').write(v.VERSION);"
                            "print(os.environ['SAE_DIST_SUBMIT_DIR'])").stdout)
    head = git(repo, "rev-parse", "HEAD").strip()
    assert plain["snapshot_commit"] == head + "+uncommitted"
    # Edited after submit: the queued jobs must not see it.
    (repo / "pkg" / "version.py").write_text("VERSION = 'edited later'\n")
    engine = get_engine()
    assert get_job(engine, plain["job_id"]).snapshot_commit == head + "+uncommitted"
    daemon = start_daemon(tmp_path / "daemon.log")
    try:
        assert cli("release", str(plain["job_id"])).returncode == 0
        assert cli("release", str(writer["job_id"])).returncode == 0
        for job_id in (plain["job_id"], writer["job_id"]):
            wait_for(lambda: get_job(engine, job_id).state == "COMPLETED", 120, f"job {job_id} to complete")
        assert (out / "plain.out").read_text() == "at submit\n"
        assert (out / "writer.out").read_text() == f"{repo}\n"
        writer_copy = Path(get_job(engine, writer["job_id"]).snapshot_dir)
        assert (writer_copy / "result.txt").read_text() == "at submit"  # it ran in the copy, wrote there
        # The plain job's copy goes; the one a job wrote into stays, saying why.
        plain_root = S.root_of(get_job(engine, plain["job_id"]).snapshot_dir)
        wait_for(lambda: not plain_root.exists(), 60, "the plain job's snapshot to go")
        wait_for((S.root_of(str(writer_copy)) / S.KEPT).exists, 60, "the written copy to be kept, saying why")
        listed = json.loads(cli("acct", "--json", "-j", str(plain["job_id"])).stdout)
        assert listed[0]["snapshot_commit"] == head + "+uncommitted"
    finally:
        kill_running_jobs()
        stop_process(daemon)

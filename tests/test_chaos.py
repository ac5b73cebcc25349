"""scripts/chaos_scheduler.py, small: daemon, supervisor and job kills, cancels and time limits
lose, duplicate, double-book and kill nothing healthy, leave no traceback anywhere, and no
process a job detached outlives its job."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # real daemons, supervisors, CLI processes


def run_chaos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/chaos_scheduler.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_small_chaos_run_loses_nothing(tmp_path):
    done = run_chaos("--jobs", "30", "--submitters", "2", "--seed", "3", "--home", str(tmp_path / "home"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for figure in ("jobs lost", "jobs duplicated", "devices double-booked", "healthy jobs killed", "tracebacks",
                   "array limits broken", "processes outlived their job"):
        assert f"{figure}: 0" in lines, done.stdout
    chaos = lines[1]  # e.g. "chaos: 2 cancel, 1 cancel-array, 1 cancel-cli, 3 daemon, 1 job, 1 supervisor; ..."
    for kind in (" cancel,", " cancel-array,", " cancel-cli,", " daemon,", " job,", " supervisor;"):
        assert kind in chaos, done.stdout  # every kind of chaos happened at least once
    assert done.stderr == ""


def test_a_bad_argument_is_one_line(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "state.db").write_text("")
    done = run_chaos("--jobs", "5", "--home", str(tmp_path / "used"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --home {tmp_path / 'used'} is not an empty directory: "
        f"the chaos run needs a state directory of its own"]
    assert (tmp_path / "used" / "state.db").read_text() == ""  # nothing stored over it

"""Job arrays end to end: `submit --array` stores every task in one transaction, a real daemon
runs them with SLURM's environment and at most %N at once, dependencies on an array wait for all
its tasks, and cancel/hold/release/acct take 12, 12_7 and 12_[3-5]."""

from __future__ import annotations

import json
import sqlite3

import pytest

from conftest import wait_for
from sae_dist.db import get_engine
from scheduler.store import count_jobs, get_job, list_jobs
from test_scheduler_cli import cli, cli_in_process, sched, submitted_id  # noqa: F401 (sched: a fixture)

pytestmark = pytest.mark.slow  # a real daemon or CLI processes


def _tasks(array_id: int) -> list:
    return sorted((j for j in list_jobs(get_engine()) if j.array_job_id == array_id), key=lambda j: j.array_task_id)


def _most_at_once(jobs) -> int:
    """The most of `jobs` that ran at the same moment (from their recorded start and end)."""
    edges = sorted([(j.started_at, 1) for j in jobs] + [(j.ended_at, -1) for j in jobs], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_a_real_daemon_runs_an_array_as_slurm_would(sched, tmp_path):
    report = 'echo "$SLURM_ARRAY_JOB_ID $SLURM_ARRAY_TASK_ID $SLURM_ARRAY_TASK_COUNT $SAE_DIST_ARRAY_TASK_ID ' \
             '$SLURM_ARRAY_TASK_MIN $SLURM_ARRAY_TASK_MAX $SAE_DIST_JOB_ID"; sleep 0.5'
    ok = submitted_id(cli("submit", "--json", "--array", "0-4%2", "-J", "ok", "-o", str(tmp_path / "%A_%a.out"),
                          "--", "sh", "-c", report))
    bad = submitted_id(cli("submit", "--json", "--array", "0-1", "-J", "bad", "--", "sh", "-c",
                           "exit $SLURM_ARRAY_TASK_ID"))
    after_ok = submitted_id(cli("submit", "--json", "-d", f"afterok:{ok}", "--", "true"))
    after_bad = submitted_id(cli("submit", "--json", "-d", f"afterok:{bad}", "--", "true"))
    after_not_ok = submitted_id(cli("submit", "--json", "-d", f"afternotok:{bad}", "--", "true"))
    sched.start_daemon()
    engine = get_engine()
    wait_for(lambda: all(get_job(engine, j).state == "COMPLETED" for j in (after_ok, after_not_ok))
             and get_job(engine, after_bad).reason == "DependencyNeverSatisfied", 60, "the dependents")

    tasks = _tasks(ok)
    assert [t.array_task_id for t in tasks] == [0, 1, 2, 3, 4] and tasks[0].id == ok
    assert all(t.state == "COMPLETED" for t in tasks)
    assert _most_at_once(tasks) == 2  # %2: never more; and both at once from the first pass
    for t in tasks:  # SLURM's variables and ours, in the %A_%a file
        assert (tmp_path / f"{ok}_{t.array_task_id}.out").read_text().split() == [
            str(ok), str(t.array_task_id), "5", str(t.array_task_id), "0", "4", str(t.id)]
    assert get_job(engine, after_ok).started_at >= max(t.ended_at for t in tasks)  # after all its tasks
    assert [t.state for t in _tasks(bad)] == ["COMPLETED", "FAILED"]
    assert get_job(engine, after_bad).state == "PENDING"

    acct = json.loads(cli("acct", "--json", "-j", f"{ok}_3,{bad}").stdout)
    assert [(r["array_job_id"], r["array_task_id"]) for r in acct] == [(ok, 3), (bad, 0), (bad, 1)]
    table = cli("acct", "-j", str(bad)).stdout.splitlines()
    assert [line.split()[0] for line in table] == ["JOBID", f"{bad}_0", f"{bad}_1"]


def test_ten_thousand_tasks_in_one_submit_and_every_way_to_name_them(sched, tmp_path, capsys):
    """The submit and the listings are real processes (the one-transaction insert, and `queue`'s
    stdlib reader over 10,000 rows); cancel, hold and release are the same CLI main in this process
    (a process each cost ~1 s of CPU; tests/test_scheduler.py and test_scheduler_cli.py run them as
    processes)."""
    done = cli("submit", "--json", "--array", "0-9999%8", "-J", "big", "--", "true")
    answer = json.loads(done.stdout)
    array_id = answer["job_id"]
    assert (answer["tasks"], answer["array"]) == (10_000, "0-9999%8")
    engine = get_engine()
    with sqlite3.connect(sched.home / "state.db") as con:
        rows = con.execute("SELECT id, array_job_id, array_task_id, array_max_running FROM jobs ORDER BY id").fetchall()
    assert [r[0] for r in rows] == list(range(array_id, array_id + 10_000))
    assert {(r[1], r[3]) for r in rows} == {(array_id, 8)} and [r[2] for r in rows] == list(range(10_000))
    line = cli("queue").stdout.splitlines()[1].split()
    assert (line[:2], line[3]) == ([f"{array_id}_[0-9999%8]", "big"], "PD")  # one line for 10,000 tasks

    out = cli_in_process(capsys, "cancel", f"{array_id}_[0-4]", f"{array_id}_9")
    assert out.stdout.splitlines() == [f"{array_id}_[0-4]: 5 tasks cancelled", f"{array_id}_9: 1 task cancelled"]
    held = cli_in_process(capsys, "hold", str(array_id))
    assert held.stdout.strip() == f"{array_id}: 9994 tasks held, 6 tasks left as they are (CANCELLED)"
    assert cli("queue").stdout.splitlines()[1].split()[0] == f"{array_id}_[5-8,10-9999%8]"
    released = cli_in_process(capsys, "release", f"{array_id}_[5-6]")
    assert released.stdout.strip() == f"{array_id}_[5,6]: 2 tasks released"
    assert [r.split()[0] for r in cli("queue").stdout.splitlines()[1:]] == [f"{array_id}_[5,6%8]",
                                                                            f"{array_id}_[7,8,10-9999%8]"]
    missing = cli_in_process(capsys, "cancel", f"{array_id}_10000", f"{array_id + 20_000}_1")
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        f"error: no task {array_id}_10000: array {array_id} has tasks 0-9999",
        f"error: no job array {array_id + 20_000} (see `queue --all`)"]
    assert cli_in_process(capsys, "cancel", str(array_id)).stdout.strip() == \
        f"{array_id}: 9994 tasks cancelled, 6 tasks left as they are (CANCELLED)"
    assert cli("queue").stdout.splitlines()[1:] == []
    assert count_jobs(engine) == 10_000


def test_a_sweep_in_one_toml(sched, tmp_path, capsys):
    toml = tmp_path / "sweep.toml"
    toml.write_text('name = "lr"\nd_in = 16\nexpansion_factor = 2\nk = 4\nsteps = 5\nbatch_size = 32\n'
                    'source = "synthetic"\n\n[[array]]\nlr = 1e-3\n\n[[array]]\nlr = 3e-4\nk = 8\n\n'
                    '[[array]]\nlr = 1e-4\n')
    done = cli_in_process(capsys, "submit", "--json", "--train", str(toml), "--array", "0-2%1", "-D", str(tmp_path))
    array_id = json.loads(done.stdout)["job_id"]
    configs = [json.loads(t.train_config_json) for t in _tasks(array_id)]
    assert [(c["name"], c["lr"], c["k"]) for c in configs] == [("lr-0", 1e-3, 4), ("lr-1", 3e-4, 8), ("lr-2", 1e-4, 4)]
    script = cli_in_process(capsys, "export-sbatch", str(array_id)).stdout.splitlines()
    assert "#SBATCH --array=0-2%1" in script and "#SBATCH --output=%x-%A_%a.out" in script
    assert sum(line.strip().startswith(("0)", "1)", "2)")) for line in script) == 3

    before = count_jobs(get_engine())
    toml.write_text(toml.read_text() + "\n[[array]]\nlr = -1.0\n")
    bad = cli_in_process(capsys, "submit", "--train", str(toml), "-D", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "[[array]] entry 3: lr" in bad.stderr
    assert count_jobs(get_engine()) == before  # nothing half stored
    for args, message in ((("--array", "0-2", "-o", "%A.out", "--", "true"), None),
                          (("-o", "%a.out", "--", "true"), "error: --output: %a is a job array's; "
                                                           "submit with --array\n"),
                          (("--array", "0-2%", "--", "true"), "error: --array '0-2%': '' is not a limit after %"
                                                               " (a whole number, 0 or more)\n")):
        done = cli_in_process(capsys, "submit", "-D", str(tmp_path), *args)
        assert (done.returncode, done.stderr) == ((0, "") if message is None else (2, message))

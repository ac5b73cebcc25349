"""Preemption with a real daemon and real jobs: a job of higher priority takes a preemptible job's
device; the preempted one gets SIGTERM and its grace time, is requeued (its run PREEMPTED in
`acct -D`), and runs again; a training goes on from the checkpoint its stop wrote and ends equal
to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LENGTH_FREE_SCHEDULE, kill_running_jobs, main_here, run_cli, start_daemon, stop_process, wait_for
from sae_dist.db import get_engine
from sae_dist.paths import state_home
from scheduler.store import get_job
from test_train import final_weights

pytestmark = pytest.mark.slow  # a real daemon and real jobs


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, module="scheduler", timeout=60)


def submit(*args: str) -> int:
    r = cli("submit", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["job_id"]


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "1")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    proc = start_daemon(tmp_path / "daemon.log")
    try:
        yield get_engine()
    finally:
        kill_running_jobs()
        stop_process(proc)


def test_bad_preemption_flags_are_one_line_and_store_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "1")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    for args, says in ((["--preemptible", "--grace-time", "-1"], "--grace-time: must be seconds, 0 or more"),
                       (["--grace-time", "5"], "--grace-time: is a preemptible job's"),
                       (["--preemptible", "--grace-time", "100000"], "over a day")):
        r = cli("submit", *args, "--", "true")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not (tmp_path / "home" / "state.db").exists() or cli("acct", "--json").stdout.strip() == "[]"


VICTIM = """
import os, signal, sys, time
marker, started = sys.argv[1], sys.argv[2]
if os.path.exists(marker):  # its second run, after the requeue: done at once
    sys.exit(0)
def on_term(*_):
    open(marker, "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(started, "w").close()
time.sleep(600)
"""


def test_a_higher_priority_job_preempts_a_command_which_is_requeued(daemon, tmp_path):
    engine = daemon
    marker, started = tmp_path / "termed", tmp_path / "started"
    victim = submit("--preemptible", "--grace-time", "30", "-J", "victim", "--gpus", "1", "--",
                    sys.executable, "-c", VICTIM, str(marker), str(started))
    wait_for(started.exists, 120, "the victim to start")
    urgent = submit("--priority", "10", "-J", "urgent", "--gpus", "1", "--", sys.executable, "-c", "print('urgent')")
    wait_for(lambda: get_job(engine, urgent).state == "COMPLETED", 120, "the urgent job to run")
    wait_for(lambda: get_job(engine, victim).state == "COMPLETED", 120, "the victim to run again and end")
    assert marker.read_text() == "SIGTERM"  # it had its grace time to stop on its own
    v, u = get_job(engine, victim), get_job(engine, urgent)
    assert v.requeue_count == 1 and v.preempted_by is None
    (attempt,) = json.loads(v.attempts_json)
    assert attempt["state"] == "PREEMPTED" and attempt["reason"] == f"Preempted by job {urgent}"
    # One device: the urgent job started only once the victim's first run had ended.
    from datetime import datetime

    assert u.started_at >= datetime.fromisoformat(attempt["ended_at"])
    listed = cli("acct", "-D", "-j", str(victim)).stdout
    assert "PREEMPTED" in listed and "COMPLETED" in listed, listed
    assert "PREEMPTED" not in cli("acct", "-j", str(victim)).stdout  # SLURM's sacct too: only with -D


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "db-false-unnamed"])
def test_a_preempted_training_resumes_and_ends_as_an_uninterrupted_one(daemon, tmp_path, recorded):
    """Rank 0 waits after step 4 until a signal comes (SAE_DIST_TEST_PAUSE_RANK_AT), so the
    preemption always lands mid-run; the stop then checkpoints at that step's report. A run the
    database does not record, with no name or directory of its own, is found again too: the
    supervisor gave it runs/job-<id>."""
    engine = daemon
    named = {"name": "preempted"} if recorded else {"db": False}
    settings = {**named, "d_in": 32, "d_sae": 128, "k": 8, "synthetic_features": 96,
                "batch_size": 64, "steps": 12, "log_every": 2, "checkpoint_every": 0}
    flags = ["--d-in", "32", "--d-sae", "128", "--k", "8", "--synthetic-features", "96", "--batch-size", "64",
             "--steps", "12", "--log-every", "2", "--checkpoint-every", "0", *LENGTH_FREE_SCHEDULE]
    schedule = dict(zip([f.removeprefix("--").replace("-", "_") for f in LENGTH_FREE_SCHEDULE[::2]],
                        [float(v) if "." in v else int(v) for v in LENGTH_FREE_SCHEDULE[1::2]]))
    toml = tmp_path / "run.toml"
    toml.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in {**settings, **schedule}.items()) + "\n")
    victim = submit("--train", str(toml), "--preemptible", "--grace-time", "120",
                    "--env", "SAE_DIST_TEST_PAUSE_RANK_AT=0:4")
    wait_for(lambda: "step      2/12" in _log(get_job(engine, victim)), 300, "the training's first report")
    run_dir = Path(_run_dir(engine, victim) if recorded else state_home() / "runs" / f"job-{victim}")
    assert run_dir.is_dir(), run_dir
    urgent = submit("--priority", "10", "--gpus", "1", "--", sys.executable, "-c", "print('urgent')")
    wait_for(lambda: get_job(engine, urgent).state == "COMPLETED", 180, "the urgent job to run")
    wait_for(lambda: get_job(engine, victim).state in ("COMPLETED", "FAILED"), 300, "the training to end")
    v = get_job(engine, victim)
    assert v.state == "COMPLETED", _log(v)
    (attempt,) = json.loads(v.attempts_json)
    assert attempt["state"] == "PREEMPTED"
    log = _log(v)
    assert "stopping at step 4: checkpoint written" in log and "checkpoints/step_00000004 at step 4" in log, log
    ok = main_here("train", *flags, "--devices", "cpu:1", "--out-dir", str(tmp_path / "straight"))
    assert ok.returncode == 0, ok.stderr
    a, b = final_weights(run_dir), final_weights(tmp_path / "straight")
    diff = max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)
    assert diff < 1e-5, f"relative weight difference {diff:.2e}"


def _run_dir(engine, job_id: int) -> str | None:
    from sqlalchemy import select

    from sae_dist.db.schema import TrainingRun

    with engine.connect() as conn:
        return conn.execute(select(TrainingRun.run_dir).where(TrainingRun.job_id == job_id)).scalar()


def _log(job) -> str:
    return Path(job.stdout_path).read_text() if job.stdout_path and Path(job.stdout_path).exists() else ""




def test_an_unrecorded_training_gets_a_directory_a_requeue_finds(tmp_path, monkeypatch):
    """db = false and no name or out_dir: the first run writes runs/job-<id>; a requeue goes on
    from the newest of its directories that holds a checkpoint, or starts in a new one."""
    from types import SimpleNamespace

    from scheduler.supervisor import checkpointed_run_dir, job_argv, unrecorded_run_dirs

    monkeypatch.setenv("SAE_DIST_HOME", str(tmp_path))
    config = json.dumps({"db": False, "steps": 5})
    first = SimpleNamespace(id=7, kind="train", train_config_json=config, requeue_count=0, workdir=str(tmp_path))
    runs = tmp_path / "runs"
    assert job_argv(first, ["virtual-0"])[-2:] == ["--out-dir", str(runs / "job-7")]
    again = SimpleNamespace(**{**vars(first), "requeue_count": 2})
    assert unrecorded_run_dirs(again) == [str(runs / "job-7-2"), str(runs / "job-7-1"), str(runs / "job-7")]
    assert checkpointed_run_dir(None, again) is None  # no checkpoint anywhere: a new directory
    assert job_argv(again, ["virtual-0"])[-2:] == ["--out-dir", str(runs / "job-7-2")]
    (runs / "job-7" / "checkpoints" / "step_00000004").mkdir(parents=True)
    (runs / "job-7" / "checkpoints" / "step_00000004" / "trainer_state.pt").write_text("")
    found = checkpointed_run_dir(None, again)
    assert found == str(runs / "job-7"), found
    assert job_argv(again, ["virtual-0"], found)[-3:] == ["--out-dir", str(runs / "job-7"), "--resume"]
    # Named, or with its own out_dir (relative to where it runs), it is where its settings say.
    named = SimpleNamespace(**{**vars(again), "train_config_json": json.dumps({"db": False, "out_dir": "mine"})})
    (tmp_path / "mine" / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "mine" / "checkpoints" / "step_00000002" / "trainer_state.pt").write_text("")
    assert checkpointed_run_dir(None, named) == str(tmp_path / "mine")
    fresh = SimpleNamespace(**{**vars(named), "requeue_count": 0})
    assert "--out-dir" not in job_argv(fresh, ["virtual-0"])  # only its own --out-dir=mine

"""`submit --exclusive` (SLURM's word): the spec, bad input through the real CLI, and a real daemon
on 4 virtual devices running an exclusive job alone, holding every device, on the 2 it asked for.

The policy's side (who waits, the reasons, backfill around an exclusive head) is tested on plain
data in test_policy.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from conftest import wait_for
from sae_dist.db import GpuSample, get_engine
from sae_dist.errors import UserError
from scheduler.spec import JobSpec, resolve_devices, resolve_gpus
from scheduler.store import count_jobs, get_job
from test_scheduler_cli import DEVICES, cli, cli_in_process, sched, submitted_id  # noqa: F401 (sched: a fixture)

MACHINE = [(i, f"GPU-{i}") for i in range(4)]


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------

def test_exclusive_count_defaults_to_every_device(tmp_path):
    every = JobSpec(argv=["x"], workdir=str(tmp_path), exclusive=True)
    assert every.gpus is None and resolve_gpus(every, MACHINE) == 4
    two = JobSpec(argv=["x"], workdir=str(tmp_path), exclusive=True, gpus=2)
    assert resolve_gpus(two, MACHINE) == 2 and resolve_devices(two, MACHINE) is None
    none = JobSpec(argv=["x"], workdir=str(tmp_path), exclusive=True, gpus=0)
    assert resolve_gpus(none, MACHINE) == 0  # the machine to itself, on no device
    train = JobSpec(kind="train", train_config={"devices": "cpu:2"}, workdir=str(tmp_path), exclusive=True)
    assert resolve_gpus(train, MACHINE) == 2  # the config's count, as without --exclusive
    assert JobSpec(argv=["x"], workdir=str(tmp_path)).gpus == 1  # not exclusive: the default is unchanged


@pytest.mark.parametrize("kwargs,flag,words", [
    ({"gpu_ids": ["0"]}, "--gpu-ids", "--exclusive"),
    ({"exclusive": "yes"}, "--exclusive", "true or false"),
])
def test_exclusive_spec_refuses(tmp_path, kwargs, flag, words):
    with pytest.raises(UserError) as e:
        JobSpec(**{"argv": ["x"], "workdir": str(tmp_path), "exclusive": True, **kwargs})
    assert str(e.value).startswith(flag + ":") and words in str(e.value)


def test_exclusive_asking_for_more_devices_than_the_machine_has(tmp_path):
    spec = JobSpec(argv=["x"], workdir=str(tmp_path), exclusive=True, gpus=5)
    with pytest.raises(UserError) as e:
        resolve_devices(spec, MACHINE)
    assert str(e.value).startswith("--exclusive:") and "5 GPUs" in str(e.value) and "has 4" in str(e.value)
    training = JobSpec(kind="train", train_config={}, workdir=str(tmp_path), exclusive=True)
    with pytest.raises(UserError, match="no devices"):
        resolve_gpus(training, [])


# ---------------------------------------------------------------------------------------------
# Bad input through the CLI: one line, exit 2, nothing stored, nothing lost
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_exclusive_bad_input_is_one_error_line_and_stores_nothing(sched, tmp_path, capsys):
    """The CLI's main in-process (the answers are the subject), the first bad one also as a real process."""
    kept = submitted_id(cli_in_process(capsys, "submit", "--json", "--hold", "--exclusive", "--gpus", "2", "-J", "kept",
                                       "--", "true"))
    before = count_jobs(get_engine())
    bad = [  # (args, what the one error line must say)
        (("submit", "--exclusive", "--gpu-ids", "0,1", "--", "true"), "--gpu-ids: cannot be combined with --exclusive"),
        (("submit", "--exclusive", "--gpus", "5", "--", "true"), "--exclusive: asked to run on 5 GPUs"),
        (("submit", "--exclusive", "--cluster", "slurm", "--", "true"), "--gpus-per-node"),
    ]
    results = [cli_in_process(capsys, *args) for args, _ in bad]
    for (args, needle), r in zip([bad[0], *bad], [cli(*bad[0][0]), *results]):
        what = f"{args}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}"
        assert r.returncode == 2 and r.stdout == "", what
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], what
    assert "has 4" in results[1].stderr
    assert count_jobs(get_engine()) == before
    job = get_job(get_engine(), kept)
    assert job.state == "PENDING" and job.exclusive and job.gpus == 2 and job.held

    # The same job as a SLURM script asks SLURM for the node to itself.
    script = cli_in_process(capsys, "export-sbatch", str(kept))
    assert script.returncode == 0 and "#SBATCH --exclusive\n" in script.stdout
    assert "#SBATCH --gpus-per-node=2\n" in script.stdout


# ---------------------------------------------------------------------------------------------
# A real daemon: the exclusive job waits for the running one, then runs alone on the machine
# ---------------------------------------------------------------------------------------------

def _waiter(flag: str, out: str | None = None) -> tuple[str, ...]:
    """A job that (optionally) writes its environment, then waits until `flag` exists (at most
    120 s, so a failed test cannot leave it behind forever)."""
    dump = f"env > {out}; " if out else ""
    return ("sh", "-c", f"{dump}i=0; while [ ! -e {flag} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done")


def _state(job_id: int) -> tuple[str, str | None]:
    job = get_job(get_engine(), job_id)
    return job.state, job.reason


@pytest.mark.slow
def test_exclusive_job_waits_then_holds_every_device(sched, tmp_path, capsys):
    """A real daemon and jobs; the submits and listings call the CLI's main in-process."""

    def cli(*args: str):
        return cli_in_process(capsys, *args)

    work = tmp_path / "work"
    work.mkdir()
    sched.start_daemon()
    engine = get_engine()

    first = submitted_id(cli("submit", "--json", "-J", "first", "-D", str(work), "--", *_waiter("stop-first")))
    wait_for(lambda: _state(first)[0] == "RUNNING", 60, "the 1-device job to run")

    exclusive = submitted_id(cli("submit", "--json", "--exclusive", "--gpus", "2", "-J", "alone", "-D", str(work),
                                 "--", *_waiter("stop-alone", "alone.env")))
    # Three devices are free, more than the 2 it runs on, but it waits for the machine to itself.
    wait_for(lambda: _state(exclusive) == ("PENDING", f"Resources, RunningJobs:{first}"), 60,
             "the exclusive job to wait for the running one")
    # A 1-device job without a time limit would delay it: it waits too (SLURM's Priority).
    later = submitted_id(cli("submit", "--json", "-J", "later", "-D", str(work), "--", "true"))
    wait_for(lambda: _state(later) == ("PENDING", "Priority"), 60, "the later job to wait behind it")
    assert _state(exclusive)[0] == "PENDING"

    (work / "stop-first").touch()
    wait_for(lambda: _state(exclusive)[0] == "RUNNING", 60, "the exclusive job to start")
    wait_for(lambda: _state(later) == ("PENDING", f"Resources, ExclusiveJob:{exclusive}"), 60,
             "the later job to wait for the exclusive one")
    job = get_job(engine, exclusive)
    runs_on = json.loads(job.devices_json)
    assert job.gpus == 2 and len(runs_on) == 2 and job.exclusive

    info, queue, queue_text = cli("info", "--json"), cli("queue", "--json"), cli("queue")
    devices = json.loads(info.stdout)
    assert len(devices) == DEVICES
    assert all(d["state"] == "allocated" and d["job_id"] == exclusive for d in devices), devices
    rows = {r["job_id"]: r for r in json.loads(queue.stdout)}
    assert rows[exclusive]["exclusive"] is True and rows[exclusive]["devices"] == runs_on
    assert sorted(rows[exclusive]["allocated"]) == sorted(d["uuid"] for d in devices)
    assert rows[later]["exclusive"] is False and rows[later]["allocated"] == []
    assert rows[later]["reason"] == f"Resources, ExclusiveJob:{exclusive}"
    line = next(x for x in queue_text.stdout.splitlines() if x.split()[0] == str(exclusive))
    assert "(exclusive, also holds" in line
    assert f"Resources, ExclusiveJob:{exclusive}" in queue_text.stdout

    # It sees the 2 devices it runs on, not the 2 it only holds.
    env = dict(x.split("=", 1) for x in wait_for(lambda: _read(work / "alone.env"), 60, "its environment")
               .splitlines() if "=" in x)
    assert env["SAE_DIST_NUM_GPUS"] == "2" and env["SAE_DIST_DEVICES"].split(",") == runs_on
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # virtual devices: no CUDA device at all

    # Its usage is that of the devices it runs on: wait for a sample of it to be written.
    def sampled() -> set[str]:
        with engine.connect() as conn:
            return set(conn.scalars(select(GpuSample.device_uuid).where(GpuSample.job_id == exclusive)))
    assert wait_for(sampled, 60, "a sample of the exclusive job") <= set(runs_on)

    (work / "stop-alone").touch()
    wait_for(lambda: _state(later)[0] == "COMPLETED", 60, "the later job to run once it ended")
    jobs = {j: get_job(engine, j) for j in (first, exclusive, later)}
    assert jobs[exclusive].state == "COMPLETED"
    # Nobody ran beside it (order of recorded times, not durations).
    assert jobs[first].ended_at <= jobs[exclusive].started_at
    assert jobs[exclusive].ended_at <= jobs[later].started_at

    sched.stop_daemons()
    assert sampled() <= set(runs_on)
    acct = {r["job_id"]: r for r in json.loads(cli("acct", "--json").stdout)}
    assert acct[exclusive]["exclusive"] is True and acct[first]["exclusive"] is False


def _read(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return text if "SAE_DIST_NUM_GPUS=" in text else None

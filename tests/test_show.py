"""`show JOB` (scontrol show job): one job whole, from plain fields and through the CLI's main on a
real state database."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from conftest import cli_in_process
from sae_dist.db import get_engine
from scheduler.show import show_fields, show_text
from scheduler.store import NewJob, finish_job, start_jobs, submit, submit_array

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def _job(**more) -> dict:
    """A jobs-table row as plain data: a pending command job, unless `more` says otherwise."""
    return {"id": 7, "name": "probe", "user": "ada", "kind": "command", "state": "PENDING", "reason": "Resources",
            "exit_code": None, "signal": None, "requeue_count": 0, "priority": 5, "held": False,
            "requeue_on_failure": True, "exclusive": False, "shared": False, "preemptible": False,
            "submitted_at": NOW - timedelta(minutes=5), "begin_at": None, "started_at": None, "ended_at": None,
            "time_limit_s": 5400.0, "gpus": 2, "mem_per_gpu": 20 * 2**30, "gpu_ids_json": None,
            "devices_json": None, "dependencies_json": json.dumps([["afterok", 3]]), "array_job_id": None,
            "array_task_id": None, "array_max_running": None, "argv_json": json.dumps(["python", "x.py", "a b"]),
            "workdir": "/w", "snapshot_commit": None, "snapshot_dir": None, **more}


def _text(job: dict, command=("python", "x.py", "a b")) -> str:
    return show_text(show_fields(job, NOW, list(command), "/w/out.log", "/w/err.log"))


def test_a_pending_job_reads_as_scontrol_prints_it():
    lines = _text(_job()).splitlines()
    assert lines[0] == "JobId=7 JobName=probe UserId=ada Kind=command"
    assert all(line.startswith("   ") for line in lines[1:])
    text = "\n".join(lines)
    for field in ("JobState=PENDING", "Reason=Resources", "ExitCode=None", "Priority=5", "Requeue=yes",
                  "StartTime=Unknown", "EndTime=Unknown", "BeginTime=None", "RunTime=None", "TimeLimit=01:30:00",
                  "Gres=gpu:2", "MemPerGPU=20G", "Devices=None", "Dependency=afterok:3",
                  "WorkDir=/w", "StdOut=/w/out.log", "StdErr=/w/err.log"):
        assert field in text.split(), (field, text)
    assert "   Command=python x.py 'a b'" in lines  # quoted as a shell would need it
    assert "ArrayJobId" not in text and "Snapshot" not in text


def test_a_finished_task_of_an_array_has_its_times_exit_and_devices():
    job = _job(state="FAILED", reason="NonZeroExitCode", exit_code=3, signal=None, requeue_count=1,
               started_at=NOW - timedelta(seconds=90), ended_at=NOW - timedelta(seconds=30), time_limit_s=None,
               mem_per_gpu=None, devices_json=json.dumps(["GPU-a", "GPU-b"]), array_job_id=5, array_task_id=2,
               array_max_running=8, snapshot_commit="abc123", snapshot_dir="/s/abc123")
    text = _text(job).split()
    for field in ("ExitCode=3:0", "Restarts=1", "RunTime=00:01:00", "TimeLimit=UNLIMITED", "MemPerGPU=None",
                  "Devices=GPU-a,GPU-b", "ArrayJobId=5", "ArrayTaskId=2", "ArrayTaskThrottle=8",
                  "Snapshot=abc123", "SnapshotDir=/s/abc123", f"EndTime={(NOW - timedelta(seconds=30)).isoformat()}"):
        assert field in text, (field, text)
    running = _text(_job(state="RUNNING", started_at=NOW - timedelta(days=1, seconds=61))).split()
    assert "RunTime=1-00:01:01" in running  # up to now, while it runs


def test_its_json_keeps_the_values_typed():
    fields = {k: v for line in show_fields(_job(), NOW, ["true"], "/o", "/o") for k, v in line}
    assert (fields["JobId"], fields["Hold"], fields["MemPerGPU"], fields["StartTime"], fields["Dependency"]) == \
        (7, False, 20 * 2**30, None, ["afterok:3"])


def test_show_through_the_cli(capsys, state_home, tmp_path):
    engine = get_engine()
    plain = submit(engine, NewJob(name="plain", kind="command", argv=["true"], gpus=1, workdir=str(tmp_path),
                                  stdout="logs/%x-%j.out"))
    train = submit(engine, NewJob(name="tr", kind="train", argv=[], gpus=2, workdir=str(tmp_path),
                                  train_config={"steps": 40, "k": 8}))
    array = submit_array(engine, [(t, NewJob(name="sw", kind="command", argv=["true"], gpus=1,
                                             workdir=str(tmp_path))) for t in range(3)])
    start_jobs(engine, [(train, ("virtual-0", "virtual-1"))], {})
    finish_job(engine, train, "COMPLETED", exit_code=0)

    code, out, err = cli_in_process(capsys, "show", str(plain))
    assert code == 0 and err == "", err
    assert f"StdOut={tmp_path}/logs/plain-{plain}.out" in out.split()  # where it will go, as the supervisor names it
    code, out, _ = cli_in_process(capsys, "show", str(train))
    assert "Command=python -m sae_dist train --k=8 --steps=40" in out and "JobState=COMPLETED" in out.split()
    assert "Devices=virtual-0,virtual-1" in out.split() and "ExitCode=0:0" in out.split()
    assert f"StdOut={state_home}/logs/{train}-tr.out" in out.split()
    code, out, _ = cli_in_process(capsys, "show", str(array))  # an array's id: each of its tasks
    assert [b.split()[0] for b in out.strip().split("\n\n")] == [f"JobId={array + t}" for t in range(3)]
    code, out, _ = cli_in_process(capsys, "show", f"{array}_1", "--json")
    assert [(j["JobId"], j["ArrayTaskId"]) for j in json.loads(out)] == [(array + 1, 1)]
    code, out, err = cli_in_process(capsys, "show", "999")
    assert (code, out, err) == (2, "", "error: no job 999 (see `queue --all`)\n")
    code, out, err = cli_in_process(capsys, "show", f"{array}_7")
    assert code == 2 and err.startswith(f"error: no task {array}_7") and out == ""


def test_the_expected_start_in_queue_start_and_show(capsys):
    """The daemon's reservation (store.set_expected_start; its writing by a real daemon is in
    test_scheduler's backfill test) as `queue --start` and `show` print it."""
    from scheduler.store import get_job, set_expected_start

    engine = get_engine()
    head, other, running = (submit(engine, NewJob(name=n, kind="command", argv=["true"], gpus=1, workdir="/w"))
                            for n in ("head", "other", "run"))
    start_jobs(engine, [(running, ("virtual-0",))], {})
    when = NOW + timedelta(hours=1)
    set_expected_start(engine, other, NOW)  # an earlier reservation...
    set_expected_start(engine, head, when)  # ...moved: one job has one at a time
    assert [get_job(engine, i).expected_start_at for i in (head, other, running)] == [when, None, None]
    code, out, _ = cli_in_process(capsys, "queue", "--start")
    header, *rows = out.splitlines()
    assert code == 0 and header.split() == ["JOBID", "NAME", "USER", "ST", "GPUS", "START_TIME", "DEVICES(REASON)"]
    user = get_job(engine, head).user
    assert [r.split()[:6] for r in rows] == [[str(head), "head", user, "PD", "1", when.isoformat()],
                                             [str(other), "other", user, "PD", "1", "N/A"]]
    code, out, _ = cli_in_process(capsys, "show", str(head), str(running))
    first, second = out.split("\n\n")
    assert f"ExpectedStart={when.isoformat()}" in first.split() and "ExpectedStart" not in second

"""`update JOB` (scontrol update): a pending job's priority, time limit and begin time changed in the
state database, the daemon told through job_changes; anything else refused, one line, nothing changed."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from conftest import cli_in_process
from sae_dist.db import get_engine
from scheduler.store import NewJob, get_job, last_change, start_jobs, submit, submit_array


def _job(name: str = "j", **more) -> NewJob:
    return NewJob(name=name, kind="command", argv=["true"], gpus=1, workdir="/w", **more)


def test_a_pending_job_takes_its_new_priority_limit_and_begin(capsys):
    engine = get_engine()
    first, second = submit(engine, _job("first")), submit(engine, _job("second", time_limit_s=600.0))
    with engine.connect() as conn:
        seen = last_change(conn)
    code, out, err = cli_in_process(capsys, "update", str(second), "--priority", "5", "-t", "1-02:00:00",
                                    "--begin", "now+2hours")
    assert code == 0 and err == "" and out.startswith(f"job {second}: priority 5, time limit 1-02:00:00, begin 20")
    job = get_job(engine, second)
    assert (job.priority, job.time_limit_s) == (5, 26 * 3600.0)
    assert timedelta(hours=1.9) < job.begin_at - datetime.now(timezone.utc) < timedelta(hours=2)
    with engine.connect() as conn:
        assert last_change(conn) > seen  # the daemon reads the change at its next pass
    # It now comes first among the pending jobs, as the scheduler orders them.
    lines = cli_in_process(capsys, "queue")[1].splitlines()[1:]
    assert [line.split()[0] for line in lines] == [str(second), str(first)]
    cli_in_process(capsys, "update", str(second), "-t", "UNLIMITED", "--begin", "now")
    assert get_job(engine, second).time_limit_s is None


def test_an_array_changes_its_pending_tasks_only(capsys):
    engine = get_engine()
    array = submit_array(engine, [(t, _job("sw")) for t in range(4)])
    start_jobs(engine, [(array, ("virtual-0",))], {})
    code, out, _ = cli_in_process(capsys, "update", str(array), "--priority", "3")
    assert code == 0
    assert out.strip() == f"{array}: 3 tasks updated (priority 3), 1 task left as they are (RUNNING)"
    assert [get_job(engine, array + t).priority for t in range(4)] == [0, 3, 3, 3]


@pytest.mark.parametrize("args, needle", [
    (("update", "{pending}"), "update: nothing to change; give --priority, -t/--time or --begin"),
    (("update", "{running}", "--priority", "9"), "job {running} is RUNNING: only a pending job can be updated"),
    (("update", "999", "--priority", "9"), "no job 999 (see `queue --all`)"),
    (("update", "{pending}", "-t", "soon"), "--time: 'soon' is not a time limit"),
    (("update", "{pending}", "--begin", "someday"), "--begin"),
    (("update", "{pending}", "--priority", "99999999999"), "--priority: 99999999999 is out of range"),
])
def test_a_bad_update_is_one_line_and_changes_nothing(capsys, args, needle):
    engine = get_engine()
    ids = {"pending": submit(engine, _job(time_limit_s=60.0)), "running": submit(engine, _job())}
    start_jobs(engine, [(ids["running"], ("virtual-0",))], {})
    before = {k: get_job(engine, v).model_dump() for k, v in ids.items()}
    code, out, err = cli_in_process(capsys, *(a.format(**ids) for a in args))
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ")
    assert needle.format(**ids) in err, err
    assert {k: get_job(engine, v).model_dump() for k, v in ids.items()} == before

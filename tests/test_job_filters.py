"""`queue -j/-t/-n`, `acct -s/--name` and `cancel -t/-n`: jobs chosen by id, state and name, as
squeue, sacct and scancel choose them, on a real state database through the CLI's own main."""

from __future__ import annotations

import pytest

from conftest import cli_in_process
from sae_dist.db import get_engine
from sae_dist.db.schema import JOB_STATES
from sae_dist.errors import UserError
from scheduler.cli import main
from scheduler.job_filters import CODES, parse_names, parse_states
from scheduler.store import NewJob, finish_job, get_job, start_jobs, submit, submit_array


def test_states_are_read_by_name_or_code_in_any_case():
    assert parse_states("pd,R,completed,Oom", "-t") == ("PENDING", "RUNNING", "COMPLETED", "OUT_OF_MEMORY")
    assert parse_states("PD,PENDING", "-t") == ("PENDING",)
    assert parse_states("all", "-t") is None and parse_states("R,ALL", "-t") is None
    assert list(CODES) == list(JOB_STATES)  # every state a job can be in, and no other
    assert parse_names("sweep1, sweep2,sweep1", "-n") == ("sweep1", "sweep2")


@pytest.mark.parametrize("text, needle", [
    ("bogus", "--states: 'bogus' is no job state; use PENDING (PD), RUNNING (R)"),
    ("PD,", "--states: 'PD,' has an empty state"),
    ("", "--states: '' has an empty state"),
])
def test_a_state_that_is_none_is_refused_by_name(text, needle):
    with pytest.raises(UserError) as e:
        parse_states(text, "--states")
    assert str(e.value).startswith(needle)


def _queued() -> dict[str, int]:
    """A pending job, a held one, a running one, a failed one, and an array of 5 pending tasks."""
    engine = get_engine()

    def job(name: str, **more) -> NewJob:
        return NewJob(name=name, kind="command", argv=["true"], gpus=1, workdir="/w", **more)

    ids = {"pending": submit(engine, job("a")), "held": submit(engine, job("b", held=True)),
           "running": submit(engine, job("a")), "failed": submit(engine, job("c"))}
    ids["array"] = submit_array(engine, [(t, job("sweep")) for t in range(5)])
    start_jobs(engine, [(ids["running"], ("virtual-0",)), (ids["failed"], ("virtual-1",))], {})
    finish_job(engine, ids["failed"], "FAILED", exit_code=3)
    return ids


def _run(capsys, *args: str) -> tuple[int, list[str], str]:
    """The CLI's main here: exit code, the table's first column (the header dropped), stderr."""
    code, out, err = cli_in_process(capsys, *args)
    return code, [line.split()[0] for line in out.splitlines()[1:]], err


def test_queue_lists_the_jobs_of_the_ids_states_and_names_given(capsys):
    ids = _queued()
    a = ids["array"]
    assert _run(capsys, "queue")[1] == [str(ids["running"]), str(ids["pending"]), str(ids["held"]), f"{a}_[0-4]"]
    assert _run(capsys, "queue", "-n", "a")[1] == [str(ids["running"]), str(ids["pending"])]
    assert _run(capsys, "queue", "-t", "pd", "-n", "a,b")[1] == [str(ids["pending"]), str(ids["held"])]
    assert _run(capsys, "queue", "-t", "R")[1] == [str(ids["running"])]
    assert _run(capsys, "queue", "-t", "F")[1] == [str(ids["failed"])]  # a finished state, without --all
    assert _run(capsys, "queue", "-t", "all", "-n", "c")[1] == [str(ids["failed"])]
    assert _run(capsys, "queue", "-n", "c")[1] == []  # PD and R only, as without a filter
    assert _run(capsys, "queue", "--all", "-n", "c")[1] == [str(ids["failed"])]
    # An array's pending tasks fold as they do unfiltered, only those chosen.
    assert _run(capsys, "queue", "-n", "sweep")[1] == [f"{a}_[0-4]"]
    assert _run(capsys, "queue", "-j", f"{a}_[1-3],{ids['held']}")[1] == [str(ids["held"]), f"{a}_[1-3]"]
    assert _run(capsys, "queue", "-j", str(a))[1] == [f"{a}_[0-4]"]
    assert _run(capsys, "queue", "-t", "R", "-n", "sweep")[1] == []
    assert _run(capsys, "queue", "-j", "999")[1] == []  # a filter: an id no job has matches nothing
    # --json: every task as it is, the same filters.
    capsys.readouterr()
    main(["queue", "--json", "-n", "sweep", "-j", f"{a}_3"])
    assert '"array_task_id": 3' in capsys.readouterr().out


def test_acct_lists_the_jobs_of_the_states_and_names_given(capsys):
    ids = _queued()
    assert _run(capsys, "acct", "-s", "F")[1] == [str(ids["failed"])]
    assert _run(capsys, "acct", "-s", "PD", "--name", "b")[1] == [str(ids["held"])]
    assert _run(capsys, "acct", "--name", "a")[1] == [str(ids["pending"]), str(ids["running"])]


def test_cancel_takes_the_jobs_its_filters_match(capsys):
    ids = _queued()
    a = ids["array"]
    engine = get_engine()
    code, _, err = _run(capsys, "cancel", "-t", "PD", "-n", "a")
    assert code == 0 and err == ""
    assert get_job(engine, ids["pending"]).state == "CANCELLED"
    assert get_job(engine, ids["running"]).state == "RUNNING" and not get_job(engine, ids["running"]).cancel_requested
    # With ids: those of them the filters match (tasks 1-2 of the array, not the held job b).
    capsys.readouterr()
    assert main(["cancel", "-n", "sweep", f"{a}_[1-2]", str(ids["held"])]) == 0
    assert capsys.readouterr().out.strip() == "2 jobs cancelled"
    assert [get_job(engine, a + t).state for t in range(5)] == ["PENDING", "CANCELLED", "CANCELLED", "PENDING",
                                                                  "PENDING"]
    assert get_job(engine, ids["held"]).state == "PENDING"
    # A running job is asked to stop; a finished one is never touched.
    assert main(["cancel", "-n", "a,c"]) == 0
    assert capsys.readouterr().out.strip() == "1 job cancelling (SIGTERM, SIGKILL after the grace period)"
    assert get_job(engine, ids["running"]).cancel_requested
    assert get_job(engine, ids["failed"]).state == "FAILED"
    assert main(["cancel", "-t", "CD"]) == 0 and capsys.readouterr().out.strip() == "no pending or running job matches"


@pytest.mark.parametrize("args, needle", [
    (("cancel",), "cancel: name the jobs: job ids (12, 12_7, 12_[3-5]), or -t/--state and -n/--name"),
    (("cancel", "-t", "PD", "slurm:12"), "cancel: -t/--state and -n/--name select local jobs"),
    (("cancel", "-t", "done"), "--state: 'done' is no job state"),
    (("cancel", "-n", "a,,b"), "--name: 'a,,b' has an empty job name"),
    (("queue", "-t", "RUN"), "--states: 'RUN' is no job state"),
    (("queue", "-n", ""), "--name: '' has an empty job name"),
    (("queue", "-j", "x"), "--jobs: 'x' is not a list of job ids"),
    (("acct", "-s", "PD,,R"), "--state: 'PD,,R' has an empty state"),
])
def test_a_bad_filter_is_one_line_and_touches_nothing(capsys, args, needle):
    ids = _queued()
    before = {k: get_job(get_engine(), v).state for k, v in ids.items()}
    code, _, err = _run(capsys, *args)
    assert code == 2 and err.strip() == f"error: {err.strip().removeprefix('error: ')}" and needle in err, err
    assert {k: get_job(get_engine(), v).state for k, v in ids.items()} == before

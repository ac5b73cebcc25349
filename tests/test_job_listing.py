"""The one reader of the jobs table: the SQLite fast path and an engine give the same rows."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from conftest import REPO
from sae_dist import job_listing
from sae_dist.db import get_engine, utcnow
from sae_dist.job_listing import JobRow, has_cluster_jobs, read_allocations, read_job, read_jobs
from scheduler.store import NewJob, finish_job, list_jobs, start_jobs, submit


def _jobs(engine) -> dict[str, int]:
    now = utcnow()
    ids = {
        "pending": submit(engine, NewJob(name="p", kind="command", argv=["true"], gpus=1, workdir="/w",
                                         priority=3, held=True), now=now - timedelta(seconds=30)),
        "running": submit(engine, NewJob(name="r", kind="train", argv=[], gpus=2, workdir="/w",
                                         train_config={"steps": 40}, exclusive=True), now=now - timedelta(seconds=20)),
        "done": submit(engine, NewJob(name="d", kind="command", argv=["true"], gpus=1, workdir="/w",
                                      gpu_ids=["virtual-3"]), now=now - timedelta(seconds=10)),
        "never": submit(engine, NewJob(name="n", kind="command", argv=["true"], gpus=1, workdir="/w")),
    }
    start_jobs(engine, [(ids["running"], ("virtual-0", "virtual-1")), (ids["done"], ("virtual-3",))], {},
               holds={ids["running"]: ("virtual-0", "virtual-1", "virtual-2")})
    finish_job(engine, ids["done"], "FAILED", exit_code=3)
    return ids


def test_the_fast_path_and_the_engine_read_the_same_rows():
    engine = get_engine()
    ids = _jobs(engine)
    fast, slow = read_jobs(), read_jobs(engine)
    assert fast == slow and [j.id for j in fast] == sorted(ids.values())
    by_id = {j.id: j for j in fast}
    running = by_id[ids["running"]]
    assert isinstance(running, JobRow) and running.state == "RUNNING"
    assert running.devices == ["virtual-0", "virtual-1"] and running.exclusive is True
    assert running.train_config() == {"steps": 40} and running.started_at.tzinfo is not None
    pending = by_id[ids["pending"]]
    assert (pending.held, pending.reason, pending.priority, pending.devices) == (True, "JobHeldUser", 3, [])
    assert by_id[ids["done"]].gpu_ids == ["virtual-3"] and by_id[ids["done"]].exit_code == 3
    assert by_id[ids["never"]].train_config() == {}
    # The same columns as the table class, decoded.
    job = next(j for j in list_jobs(engine) if j.id == ids["running"])
    assert (running.submitted_at, running.started_at) == (job.submitted_at, job.started_at)
    assert running.devices == json.loads(job.devices_json)


def test_filters_orders_and_limits():
    engine = get_engine()
    ids = _jobs(engine)
    assert [j.id for j in read_jobs(states=("PENDING",))] == [ids["pending"], ids["never"]]
    assert [j.id for j in read_jobs(states=())] == []
    assert [j.id for j in read_jobs(order="newest", limit=2)] == [ids["never"], ids["done"]]
    assert [j.id for j in read_jobs(engine, started_only=True)] == [ids["running"], ids["done"]]
    assert [j.id for j in read_jobs(engine, order="last_ended", states=("FAILED",))] == [ids["done"]]
    assert read_job(engine, ids["done"]).state == "FAILED" and read_job(engine, 999) is None
    assert read_job(engine, ids["pending"]).as_dict()["devices"] == []
    with pytest.raises(ValueError, match="unknown order"):
        read_jobs(order="oldest")
    assert read_allocations() == read_allocations(engine) == {
        ids["running"]: ["virtual-0", "virtual-1", "virtual-2"]}
    assert has_cluster_jobs() is False


def test_without_a_sqlite_file_it_takes_the_regular_path(state_home, monkeypatch):
    assert job_listing._fetch_sqlite("SELECT 1", {}) is None  # no state file yet
    assert read_jobs() == []  # the engine creates (and migrates) the database
    assert (state_home / "state.db").is_file()
    monkeypatch.setenv("SAE_DIST_DB_URL", "postgresql://nowhere/db")
    assert job_listing.sqlite_file() is None and has_cluster_jobs() is None


def test_a_listing_imports_neither_sqlalchemy_nor_torch():
    code = ("import sys; from sae_dist.job_listing import read_jobs; read_jobs(); "
            "print(sorted(m for m in ('sqlalchemy', 'sqlmodel', 'torch') if m in sys.modules))")
    get_engine()  # the database exists: the fast path answers
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_pending_tasks_group_by_array_reason_and_hold(tmp_path, monkeypatch):
    """What `queue` folds into one row: an array's pending tasks waiting for the same reason and
    hold; running and finished tasks, and plain jobs, are in no group."""
    from scheduler.arrays import parse_array
    from scheduler.spec import JobSpec
    from scheduler.store import set_held_many
    from scheduler.submit import submit_spec

    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    engine = get_engine()
    array = submit_spec(engine, JobSpec(argv=["true"], gpus=0, workdir=str(tmp_path)), [],
                        array=parse_array("0-9%2"))
    plain = submit(engine, NewJob(name="plain", kind="command", argv=["true"], gpus=0, workdir=str(tmp_path)))
    start_jobs(engine, [(array, ())], {array + 2: "JobArrayTaskLimit", array + 3: "JobArrayTaskLimit"})
    finish_job(engine, array, "COMPLETED", exit_code=0)
    set_held_many(engine, [array + 8, array + 9], True)
    groups = job_listing.pending_task_groups()
    assert groups == {array + 1: [1, 4, 5, 6, 7], array + 2: [2, 3], array + 8: [8, 9]}
    assert plain not in groups and job_listing.pending_task_groups(engine) == groups  # both connections

"""A job's real end reached while the state database cannot be written is not lost: its
supervisor (a real forked process running a real job) keeps it in the job's directory and
records it once it can; when the supervisor is gone, the daemon's reaper replays it instead
of NODE_FAIL. Faults are real: a lock held by another connection, a file-size limit."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sqlite3

import pytest

from conftest import wait_for
from sae_dist.db import get_engine
from scheduler import final_state
from scheduler.newjob import new_job
from scheduler.spec import JobSpec
from scheduler.store import get_job, start_jobs, submit


@pytest.fixture
def running_job(state_home, monkeypatch, tmp_path):
    """A RUNNING job whose supervisor runs in a forked child; the job exits 3 once `go` exists.
    Yields (engine, job id, supervisor pid, go file, its stderr file)."""
    monkeypatch.setenv("SAE_DIST_DB_BUSY_TIMEOUT_S", "0.2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    go, log = tmp_path / "go", tmp_path / "supervisor.err"
    engine = get_engine()
    spec = JobSpec(argv=["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exit 3"], workdir=str(tmp_path))
    job_id = submit(engine, new_job(spec, [(0, "virtual-0")]))
    assert start_jobs(engine, [(job_id, ("virtual-0",))], {})
    engine.dispose()  # no connection crosses the fork
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            import logging

            # As the daemon's supervisors log, to a file (pytest's own handlers stay out of it).
            logging.basicConfig(stream=open(log, "a", buffering=1), level=logging.INFO, force=True)
            from scheduler.supervisor import supervise

            code = supervise(job_id)
        finally:
            os._exit(code)
    try:
        wait_for(lambda: get_job(engine, job_id).pid, what="the job to start")
        yield engine, job_id, pid, go, log
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):  # the test reaped it already
            pass


def _hold_write_lock(home) -> sqlite3.Connection:
    con = sqlite3.connect(home / "state.db", isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    return con


def test_the_reaper_records_the_end_a_vanished_supervisor_kept(running_job, state_home):
    engine, job_id, supervisor, go, log = running_job
    lock = _hold_write_lock(state_home)
    go.touch()  # the job exits 3 while nobody else can write
    wait_for(lambda: "the database cannot take it yet (it is locked" in log.read_text(), what="a refused write")
    kept = final_state.kept(job_id)
    assert (kept.state, kept.exit_code, kept.signal) == ("FAILED", 3, None)
    assert json.loads(final_state.record_path(job_id).read_text())["state"] == "FAILED"
    assert get_job(engine, job_id).state == "RUNNING"  # the database has not got it yet
    os.kill(supervisor, signal.SIGKILL)  # and the supervisor dies before it could record it
    os.waitpid(supervisor, 0)
    lock.execute("ROLLBACK")
    lock.close()
    assert final_state.replay_final_state(engine, job_id) == "FAILED"  # what the reaper calls
    job = get_job(engine, job_id)
    assert (job.state, job.exit_code, job.ended_at) == ("FAILED", 3, kept.ended())
    assert not final_state.record_path(job_id).exists()
    assert final_state.replay_final_state(engine, job_id) is None  # nothing kept: NODE_FAIL is the truth


def test_the_supervisor_records_the_end_once_the_storage_takes_it(running_job, state_home):
    engine, job_id, supervisor, go, log = running_job
    soft, hard = resource.prlimit(supervisor, resource.RLIMIT_FSIZE)
    resource.prlimit(supervisor, resource.RLIMIT_FSIZE, (1024, hard))  # its database writes now fail
    lock = _hold_write_lock(state_home)  # and the WAL grows past 1024 bytes before it may write
    lock.execute('INSERT INTO devices ("uuid", "index", "name", "virtual", "available", "memory_total", '
                 '"updated_at") VALUES (\'pad\', 9, ?, 1, 1, 1, \'2026-01-01 00:00:00\')', ("x" * 4096,))
    lock.execute("COMMIT")
    lock.close()
    go.touch()
    wait_for(lambda: "the database cannot take it yet (a write failed" in log.read_text(), what="a refused write")
    assert final_state.kept(job_id).exit_code == 3 and get_job(engine, job_id).state == "RUNNING"
    resource.prlimit(supervisor, resource.RLIMIT_FSIZE, (soft, hard))  # the disk has room again
    wait_for(lambda: get_job(engine, job_id).state == "FAILED", what="the supervisor to record it")
    assert os.waitpid(supervisor, 0)[1] == 0
    assert get_job(engine, job_id).exit_code == 3
    assert not final_state.record_path(job_id).parent.exists()  # no empty directory per job left


def test_an_end_kept_for_an_earlier_run_is_not_recorded(state_home, tmp_path):
    engine = get_engine()
    job_id = submit(engine, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), [(0, "virtual-0")]))
    start_jobs(engine, [(job_id, ("virtual-0",))], {})
    earlier = final_state.FinalState("FAILED", 1, None, None, "2026-01-01T00:00:00+00:00",
                                     started_at="2025-12-31T00:00:00+00:00")
    assert final_state.keep(job_id, earlier)
    assert final_state.replay_final_state(engine, job_id) == "RUNNING"
    assert get_job(engine, job_id).state == "RUNNING" and not final_state.record_path(job_id).exists()


def test_the_database_watch_sees_a_file_or_directory_removed_or_replaced(tmp_path):
    from scheduler.storage_watch import DatabaseWatch

    def fresh(home):
        home.mkdir()
        sqlite3.connect(home / "state.db").close()
        return DatabaseWatch(home / "state.db")

    watch = fresh(tmp_path / "a")
    assert not watch.lost()
    (tmp_path / "a" / "state.db").unlink()
    assert watch.lost()
    watch = fresh(tmp_path / "b")
    os.replace(tmp_path / "b", tmp_path / "b-moved")  # moved away: its path names nothing
    assert watch.lost()
    watch = fresh(tmp_path / "c")
    shutil.rmtree(tmp_path / "c")
    fresh(tmp_path / "c")  # made again at the same path: a new directory, a new file
    assert watch.lost()
    assert not DatabaseWatch(None).lost()  # not a SQLite file (a server): never lost to the watch
    assert not DatabaseWatch(tmp_path / "none" / "state.db").lost()  # could not look at it: no evidence


def test_an_end_is_neither_kept_nor_recorded_once_its_database_is_lost(state_home):
    engine = get_engine()
    job_id = submit(engine, new_job(JobSpec(argv=["true"], workdir=str(state_home)), [(0, "virtual-0")]))
    assert start_jobs(engine, [(job_id, ("virtual-0",))], {})
    final = final_state.FinalState("COMPLETED", 0, None, None, "2026-11-30T00:00:00+00:00",
                                   started_at=get_job(engine, job_id).started_at.isoformat())
    assert final_state.record_until_stored(engine, job_id, final, lost=lambda: True) is None
    assert final_state.kept(job_id) is None and get_job(engine, job_id).state == "RUNNING"
    assert final_state.record_until_stored(engine, job_id, final) == "COMPLETED"


@pytest.mark.parametrize("asked", [True, False], ids=["cancel-requested", "bare-signal"])
def test_a_cancel_taken_for_a_bare_signal_is_recorded_as_the_users(state_home, asked):
    """The supervisor names a stop "not by a cancel" when it saw only the signal (its read of the
    request failed, or began before the request was committed); the request in the job's row says
    otherwise, and wins: store.finish_job reads it in the transaction that ends the job. Without a
    request, a bare signal stays a bare signal."""
    from scheduler.store import cancel

    engine = get_engine()
    job_id = submit(engine, new_job(JobSpec(argv=["true"], workdir=str(state_home)), [(0, "virtual-0")]))
    assert start_jobs(engine, [(job_id, ("virtual-0",))], {})
    if asked:
        assert cancel(engine, job_id) == "requested"
    stray = "Stopped by SIGTERM to its supervisor, not by a cancel"
    final = final_state.FinalState("CANCELLED", 143, 15, stray, "2026-11-30T00:00:00+00:00", cancelled=True,
                                   started_at=get_job(engine, job_id).started_at.isoformat())
    assert final_state.record(engine, job_id, final) == "CANCELLED"
    assert get_job(engine, job_id).reason == ("Cancelled by user" if asked else stray)

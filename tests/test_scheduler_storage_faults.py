"""Every command facing a state database it cannot use: read-only (root without
CAP_DAC_OVERRIDE, or a plain user), past a file-size limit (prlimit --fsize), locked past the
busy timeout by another process. Each prints one line naming the problem and the state
directory, exits 1, no traceback, and stores nothing; a reader that can still read answers."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from conftest import REPO, hold_write_lock
from sae_dist.db import get_engine
from sae_dist.errors import UserError
from scheduler.newjob import new_job
from scheduler.spec import JobSpec
from scheduler.storage_errors import storage_problem
from scheduler.store import set_held, submit

WRITERS = [("submit", "--", "true"), ("cancel", "1"), ("hold", "1"), ("release", "2"), ("requeue", "3")]
READERS = [("queue", "--all"), ("acct",), ("info",)]


@pytest.fixture
def jobs(state_home, monkeypatch, tmp_path):
    """Job 1 pending, 2 held, 3 completed; no connection left open (no -wal or -shm file)."""
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_DB_BUSY_TIMEOUT_S", "0.3")
    engine = get_engine()
    for _ in range(3):
        submit(engine, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), [(0, "virtual-0")]))
    set_held(engine, 2, True)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE jobs SET state = 'COMPLETED', exit_code = 0 WHERE id = 3")
    engine.dispose()
    return state_home


def _rows(home) -> list:
    with sqlite3.connect(home / "state.db") as con:
        rows = con.execute("SELECT * FROM jobs ORDER BY id").fetchall()
    con.close()
    return rows


def _run_all(commands, prefix=(), env=None) -> list[subprocess.CompletedProcess]:
    """The commands at once, each a real `python -m scheduler` process."""
    procs = [subprocess.Popen([*prefix, sys.executable, "-m", "scheduler", *c], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
             for c in commands]
    return [subprocess.CompletedProcess(c, p.wait(60), *p.communicate()) for c, p in zip(commands, procs)]


def _assert_one_line(result, home, problem: str) -> None:
    assert result.returncode == 1, (result.args, result.stderr)
    assert result.stderr == f"error: the state database in {home}: {problem}\n" or \
        (result.stderr.startswith(f"error: the state database in {home}: {problem}")
         and result.stderr.count("\n") == 1), (result.args, result.stderr)


def test_a_read_only_database(jobs):
    before = _rows(jobs)
    prefix = ()
    if os.geteuid() == 0:  # root writes anything unless it gives up CAP_DAC_OVERRIDE
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE as root")
        prefix = ("setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override")
    files = [jobs / name for name in os.listdir(jobs)]
    for path in files:
        path.chmod(0o444)
    jobs.chmod(0o555)
    try:
        results = _run_all(WRITERS + READERS, prefix)
    finally:
        jobs.chmod(0o755)
        for path in files:
            path.chmod(0o644)
    for result in results:  # a WAL database cannot even be read without writing its -shm file
        _assert_one_line(result, jobs, "it is read-only (its files or their directory cannot be written)")
    assert _rows(jobs) == before


def test_a_file_size_limit(jobs):
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is needed")
    before = _rows(jobs)
    # Every command meets the fault in the read-only test; here the fast and the SQLAlchemy paths.
    results = _run_all([WRITERS[0], WRITERS[1], READERS[0]], ("prlimit", "--fsize=1024"))
    for result in results:
        _assert_one_line(result, jobs, "a write failed: this process may write files of at most 1024 bytes")
    assert _rows(jobs) == before
    assert _run_all([WRITERS[0]])[0].returncode == 0  # and it recovers once the limit is gone


def test_a_lock_held_past_the_busy_timeout(jobs):
    holder = hold_write_lock(jobs / "state.db")
    try:
        assert holder.stdout.readline() == "held\n"
        before = _rows(jobs)
        writers, readers = _run_all([WRITERS[0], WRITERS[4]]), _run_all(READERS[:2])
    finally:
        holder.communicate("", timeout=30)
    for result in writers:
        _assert_one_line(result, jobs, "it is locked by another process (waited 0.3 s; "
                                       "SAE_DIST_DB_BUSY_TIMEOUT_S sets how long to wait)")
    for result in readers:  # WAL: a reader is never blocked by a writer (`queue` notes that no daemon runs)
        stderr = "".join(line for line in result.stderr.splitlines(keepends=True)
                         if not line.startswith("note: no scheduler daemon runs for "))
        assert (result.returncode, stderr) == (0, ""), (result.args, result.stderr)
    assert _rows(jobs) == before


def test_a_supervisor_records_its_jobs_process_once_the_lock_is_gone(state_home, tmp_path, monkeypatch):
    """The job already runs when its supervisor records the process: a locked database then is
    no reason to stop supervising; the record is tried again (at the next poll) until stored."""
    from scheduler.store import get_job, start_jobs
    from scheduler.supervisor import _record_process

    monkeypatch.setenv("SAE_DIST_DB_BUSY_TIMEOUT_S", "0.3")
    engine = get_engine()
    job_id = submit(engine, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), [(0, "virtual-0")]))
    start_jobs(engine, [(job_id, ("virtual-0",))], {})
    process = dict(pid=os.getpid(), pgid=os.getpid(), proc_start_ticks=1, stdout_path="o", stderr_path="o")
    holder = hold_write_lock(state_home / "state.db")
    try:
        assert holder.stdout.readline() == "held\n"
        assert _record_process(engine, job_id, process) is False  # refused: no exception, no half write
        assert get_job(engine, job_id).pid is None
    finally:
        holder.communicate("", timeout=30)
    assert _record_process(engine, job_id, process) is True
    assert get_job(engine, job_id).pid == os.getpid()


def test_storage_problems_in_words():
    class Wrapped(Exception):  # how SQLAlchemy's DBAPIError carries the driver's error
        def __init__(self, orig):
            self.orig = orig

    locked = sqlite3.OperationalError("database is locked")
    assert storage_problem(locked, 2.0).startswith("it is locked by another process (waited 2 s;")
    assert storage_problem(Wrapped(locked)) == storage_problem(locked)
    # A lock error sooner than the busy timeout could pass: SQLite gave up at once (a deadlock it detects)
    assert storage_problem(locked, 30.0, ran_s=0.4) == (
        "it is locked by another process (SQLite gave up after 0.4 s, before its 30 s busy timeout: "
        "SQLite's 'database is locked'); try again")
    assert storage_problem(locked, 2.0, ran_s=2.5).startswith("it is locked by another process (waited 2 s;")
    assert storage_problem(sqlite3.OperationalError("attempt to write a readonly database")).startswith(
        "it is read-only")
    assert storage_problem(sqlite3.OperationalError("database or disk is full")) == "the disk is full"
    io = sqlite3.OperationalError("disk I/O error")
    assert storage_problem(io).startswith("a write failed (disk I/O error")
    assert storage_problem(io, free_bytes=0) == "the disk is full (0 bytes free)"
    assert "at most 4096 bytes" in storage_problem(io, free_bytes=10**9, file_size_limit=4096)
    assert storage_problem(sqlite3.DatabaseError("file is not a database")) == "it is damaged or not a SQLite database"
    assert (storage_problem(OSError(errno.ENOSPC, "No space left", "/s/daemon.log"))
            == "the disk is full (/s/daemon.log)")
    assert storage_problem(PermissionError(errno.EACCES, "denied")) == "permission denied"
    assert storage_problem(OSError(errno.EFBIG, "too big")) == "a file-size limit was reached"
    # Not storage faults: bugs, which must surface as themselves.
    for error in (sqlite3.IntegrityError("UNIQUE constraint failed"), ValueError("x"), KeyError("y"),
                  OSError(errno.ENOENT, "gone"), UserError("mine")):
        assert storage_problem(error) is None


def test_the_daemon_and_a_supervisor_ride_out_a_locked_database(state_home, tmp_path, monkeypatch):
    """Another process holds the database's write lock while a job ends: its supervisor keeps
    the end on disk and the daemon's passes fail (one line, no traceback); once the lock goes,
    the job is recorded COMPLETED with its real exit code and the next job runs, with the same
    daemon."""
    from conftest import start_daemon, stop_process, wait_for

    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_DB_BUSY_TIMEOUT_S", "0.3")
    gate = tmp_path / "gate"
    engine = get_engine()
    devices = [(0, "virtual-0"), (1, "virtual-1")]
    waits = [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"]
    first = submit(engine, new_job(JobSpec(argv=waits, workdir=str(tmp_path)), devices))
    engine.dispose()

    def state(job_id: int) -> str:
        with sqlite3.connect(state_home / "state.db") as con:  # readers are not blocked by a writer
            found = con.execute("SELECT state, exit_code FROM jobs WHERE id = ?", (job_id,)).fetchone()
        con.close()
        return found

    def job_pid(job_id: int) -> int | None:
        with sqlite3.connect(state_home / "state.db") as con:
            found = con.execute("SELECT pid FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        con.close()
        return found

    log = state_home / "daemon-test.log"
    daemon = start_daemon(log)
    holder = None
    try:
        wait_for(lambda: state(first)[0] == "RUNNING", 60, "the job to run")
        # RUNNING is the daemon's write; the supervisor then registers and records the job's
        # process. Lock only after that, or the supervisor cannot register and the job never runs.
        wait_for(lambda: job_pid(first) is not None, 60, "the job's process to be recorded")
        holder = hold_write_lock(state_home / "state.db")
        assert holder.stdout.readline() == "held\n"
        gate.touch()
        wait_for(lambda: (state_home / "jobs" / str(first) / "final.json").exists(), 60, "the end kept on disk")
        wait_for(lambda: "it is locked by another process" in log.read_text(), 60, "the daemon to say so")
        assert state(first)[0] == "RUNNING"
        holder.communicate("", timeout=30)
        wait_for(lambda: state(first) == ("COMPLETED", 0), 60, "the kept end to be recorded")
        second = submit(get_engine(), new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), devices))
        wait_for(lambda: state(second) == ("COMPLETED", 0), 60, "the next job to run")
        assert daemon.poll() is None
        text = log.read_text()
        assert "Traceback" not in text and "takes writes again" in text, text
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        stop_process(daemon)

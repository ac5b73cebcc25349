"""No healthy job is lost to a daemon's death, whenever it dies; one daemon per state home."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import REPO, kill_running_jobs, wait_for
from sae_dist.db import get_engine
from scheduler.store import NewJob, active_allocations, cancel, get_job, list_jobs, start_jobs, submit

pytestmark = pytest.mark.slow  # real daemons, supervisors and jobs


@pytest.fixture
def home(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    state_home.mkdir(parents=True, exist_ok=True)
    yield state_home
    kill_running_jobs()


def fork_daemon(home) -> int:
    """A daemon forked from this already-imported process: it starts in milliseconds."""
    get_engine().dispose()  # no SQLite connection crosses the fork
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(home / "daemon-test.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import logging

            # pytest's capture replaced sys.stderr and the root logger's handlers: the daemon's
            # log goes to the file instead.
            sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
            logging.root.handlers.clear()
            from scheduler.daemon import main

            code = main()
        except BaseException:  # said in the log: os._exit below would swallow it
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def lock_holders(home) -> list[str]:
    """Every process with the daemon's lock file open: pid, state and command line."""
    target = str((home / "daemon.lock").resolve())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in fds):
                stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                wchan = open(f"/proc/{pid}/wchan").read()
                found.append(f"{pid} ppid {stat[1]} state {stat[0]} wchan {wchan}")
        except OSError:
            pass
    return found


def counting_job(home) -> NewJob:
    """Appends its id to runs.txt: a job that ran twice, or never, shows there."""
    return NewJob(name="count", kind="command", gpus=1, workdir=str(home),
                  argv=["sh", "-c", 'echo "$SAE_DIST_JOB_ID" >> runs.txt'])


def test_a_daemon_sigkilled_0_to_20_ms_after_running_loses_no_job(home):
    """100 daemons, each SIGKILLed 0-20 ms after its job reads RUNNING (before the fork of the
    supervisor, during it, before the supervisor registers, or after): every job runs once and
    ends COMPLETED; a job whose supervisor never came to be went back to the queue."""
    from scheduler.daemon import Daemon

    engine = get_engine()
    rng = random.Random(5)
    ids = [submit(engine, counting_job(home))]
    # One pass here first: the forked daemons inherit its compiled statements and start in ms.
    assert Daemon(engine).scheduling_pass() == ids
    db = sqlite3.connect(home / "state.db", timeout=30)
    for _ in range(100):
        job_id = submit(engine, counting_job(home))
        ids.append(job_id)
        daemon = fork_daemon(home)
        deadline = time.monotonic() + 30
        while db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] == "PENDING":
            assert time.monotonic() < deadline, \
                f"the daemon never started the job; its wait status {os.waitpid(daemon, os.WNOHANG)}; " \
                f"daemon.lock open in {lock_holders(home)}; its log: " \
                f"{(home / 'daemon-test.log').read_text()[-3000:]}"
            time.sleep(0.0005)
        # A third at once (mostly before the fork), a third within 2 ms (the supervisor not yet
        # registered), a third up to 20 ms (registered, or the job already done).
        time.sleep(rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.02)]))
        os.kill(daemon, signal.SIGKILL)
        os.waitpid(daemon, 0)
    last = fork_daemon(home)
    try:
        wait_for(lambda: all(get_job(engine, i).state not in ("PENDING", "RUNNING") for i in ids), 60,
                 "every job to end")
    finally:
        os.kill(last, signal.SIGTERM)
        os.waitpid(last, 0)
    ended = {j.id: j.state for j in list_jobs(engine) if j.id in ids}
    assert ended == {i: "COMPLETED" for i in ids}
    runs = sorted(int(x) for x in (home / "runs.txt").read_text().split())
    assert runs == ids  # each ran exactly once
    with engine.connect() as conn:
        assert active_allocations(conn) == {}


def test_a_job_whose_supervisor_never_came_goes_back_to_the_queue(home):
    """RUNNING with no supervisor registered and none of ours on its way: it never ran. It is
    queued again (and runs); one cancelled meanwhile ends CANCELLED; neither is NODE_FAIL."""
    from scheduler.daemon import Daemon

    engine = get_engine()
    orphan, cancelled = submit(engine, counting_job(home)), submit(engine, counting_job(home))
    start_jobs(engine, [(orphan, ("virtual-0",)), (cancelled, ("virtual-1",))], {})
    assert cancel(engine, cancelled) == "requested"
    daemon = Daemon(engine)
    daemon.scheduling_pass()  # puts them back, then plans: the orphan starts again, on a supervisor
    assert get_job(engine, cancelled).state == "CANCELLED"
    done = wait_for(lambda: (j := get_job(engine, orphan)).state == "COMPLETED" and j, 30, "the orphan to run")
    assert done.exit_code == 0 and (home / "runs.txt").read_text().split() == [str(orphan)]


def test_two_detached_daemons_at_once_one_starts(home):
    from scheduler.control import daemon_running, stop_daemon

    both = [subprocess.Popen([sys.executable, "-m", "scheduler", "daemon", "--detach"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in both]
        assert [p.returncode for p in both] == [0, 0] and not any(err for _, err in outs), outs
        said = sorted("started" if "daemon started" in out else out.strip() for out, _ in outs)
        assert said[1] == "started" and said[0].startswith("a daemon already runs for"), outs
        assert daemon_running()
    finally:
        stop_daemon()


def test_a_storm_of_wake_ups_never_hangs_the_daemon(home):
    """Wake-ups (SIGUSR1) arriving while the daemon's loop is inside its own wake-up bookkeeping
    hung it for good when a handler took a lock (seen in a chaos run): it scheduled nothing more
    and ignored SIGTERM. A storm of them, then a job: it still runs, and SIGTERM still stops it."""
    from scheduler.daemon import Daemon

    engine = get_engine()
    Daemon(engine).scheduling_pass()  # compiled statements for the forked daemon
    daemon = fork_daemon(home)
    try:
        wait_for(lambda: (home / "daemon.pid").exists() and int((home / "daemon.pid").read_text().split()[0]) == daemon,
                 30, "the daemon")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for _ in range(200):
                os.kill(daemon, signal.SIGUSR1)
        job_id = submit(engine, counting_job(home))
        os.kill(daemon, signal.SIGUSR1)
        wait_for(lambda: get_job(engine, job_id).state == "COMPLETED", 30, "the job after the storm")
        os.kill(daemon, signal.SIGTERM)
        wait_for(lambda: os.waitpid(daemon, os.WNOHANG)[0] == daemon, 30, "the daemon to stop on SIGTERM")
    except BaseException:
        os.kill(daemon, signal.SIGKILL)
        os.waitpid(daemon, 0)
        raise

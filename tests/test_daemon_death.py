"""No healthy job is lost to a daemon's death, whenever it dies; one daemon per state home."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import REPO, hold_write_lock, kill_running_jobs, start_daemon, stop_process, wait_for
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


def evidence(home, daemon: int, job_state: str) -> str:
    """Where a daemon that did not get a job done stood: the job's state, the daemon's process
    state and kernel wait, and its log's last lines."""
    try:
        stat = open(f"/proc/{daemon}/stat").read().rsplit(")", 1)[1].split()
        where = f"daemon state {stat[0]} wchan {open(f'/proc/{daemon}/wchan').read()}"
    except OSError:
        where = "daemon gone"
    log = home / "daemon-test.log"
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else ["(no log)"]
    return f"job {job_state}, {where}; the daemon's log ends:\n" + "\n".join(tail)


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
        try:
            # A hung daemon never gets there: the bound only ends the wait, so it is generous (the
            # job takes seconds; one CI run on a loaded host passed 30 s without it).
            wait_for(lambda: get_job(engine, job_id).state == "COMPLETED", 120, "the job after the storm")
        except AssertionError as e:  # say where it stood
            raise AssertionError(f"{e}; {evidence(home, daemon, get_job(engine, job_id).state)}") from None
        os.kill(daemon, signal.SIGTERM)
        wait_for(lambda: os.waitpid(daemon, os.WNOHANG)[0] == daemon, 30, "the daemon to stop on SIGTERM")
    except BaseException:
        os.kill(daemon, signal.SIGKILL)
        os.waitpid(daemon, 0)
        raise


def test_a_supervisor_that_dies_before_registering_puts_its_job_back(home, monkeypatch):
    """The database refuses the supervisor's first write (here another process holds its lock;
    a read-only database does the same): the job never ran, so it goes back to PENDING with its
    devices freed, not NODE_FAIL. The third such death in a row fails it, saying why."""
    from scheduler.daemon import MAX_LAUNCH_FAILURES, Daemon

    monkeypatch.setenv("SAE_DIST_DB_BUSY_TIMEOUT_S", "0.2")
    engine = get_engine()
    job_id = submit(engine, counting_job(home))
    daemon = Daemon(engine)
    for attempt in range(1, MAX_LAUNCH_FAILURES + 1):
        start_jobs(engine, [(job_id, ("virtual-0",))], {})
        holder = hold_write_lock(home / "state.db")
        try:
            assert holder.stdout.readline() == "held\n"
            daemon._spawn_supervisor(job_id)

            def collected() -> bool:
                daemon._reap_children()
                return daemon.spawned[job_id] in daemon.exited
            wait_for(collected, 30, "the supervisor to die on the refused write")
        finally:
            holder.communicate("", timeout=30)
        assert daemon._reap(_running(engine), time.time()) == []
        assert _allocations(engine) == {}
        job = get_job(engine, job_id)
        if attempt < MAX_LAUNCH_FAILURES:
            assert (job.state, job.reason, job.devices_json) == ("PENDING", None, None), attempt
    assert job.state == "NODE_FAIL"
    assert job.reason.startswith(f"its supervisor died before starting it, {MAX_LAUNCH_FAILURES} times in a row")
    assert not (home / "runs.txt").exists()  # it never ran


def test_a_job_that_ignores_sigterm_after_its_supervisor_died_stalls_nothing(home, tmp_path):
    """Its supervisor SIGKILLed, the job ignores SIGTERM: each pass signals and moves on (the
    daemon waited out the 5 s grace inside a pass, holding every other job), the job's device
    stays held while its process lives, SIGKILL comes after the grace, then NODE_FAIL."""
    from scheduler import procs
    from scheduler.daemon import KILL_GRACE_S, Daemon

    engine = get_engine()
    termed = tmp_path / "got-sigterm"
    stubborn = NewJob(name="stubborn", kind="command", gpus=1, workdir=str(home), argv=[
        sys.executable, "-c", "import signal, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: open({str(termed)!r}, 'w').close())\n"
        "print('up', flush=True)\nwhile True: time.sleep(0.05)"])
    job_id = submit(engine, stubborn)
    daemon = Daemon(engine)
    assert daemon.scheduling_pass() == [job_id]
    job = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 30, "the job's process to be recorded")
    wait_for(lambda: "up" in _job_out(job), 30, f"the job to set its handler ({get_job(engine, job_id)})")
    os.kill(job.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: not procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks) or daemon._reap_children(),
             30, "the supervisor to die")
    try:
        now = time.time()
        assert [j.id for j in daemon._reap(_running(engine), now)] == [job_id]  # SIGTERM, no wait
        wait_for(termed.exists, 30, "the SIGTERM to arrive")
        assert [j.id for j in daemon._reap(_running(engine), now + 1)] == [job_id]  # in its grace
        assert _allocations(engine) == {"virtual-0": job_id}
        assert procs.is_alive(job.pid, job.proc_start_ticks)
        daemon._reap(_running(engine), now + KILL_GRACE_S)  # SIGKILL
        wait_for(lambda: not procs.is_alive(job.pid, job.proc_start_ticks), 30, "SIGKILL to end it")
        assert daemon._reap(_running(engine), now + KILL_GRACE_S + 1) == []
        assert _allocations(engine) == {}
        assert get_job(engine, job_id).state == "NODE_FAIL"
    finally:
        if procs.is_alive(job.pid, job.proc_start_ticks):
            os.kill(job.pid, signal.SIGKILL)


def _running(engine) -> list:
    from scheduler.store import running_jobs

    with engine.connect() as conn:
        return running_jobs(conn)


def _allocations(engine) -> dict:
    with engine.connect() as conn:
        return active_allocations(conn)


def _job_out(job) -> str:
    try:
        return open(job.stdout_path).read() if job.stdout_path else ""
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("made_again", [False, True], ids=["removed", "removed-and-made-again"])
def test_a_daemon_whose_state_home_is_removed_stops(home, tmp_path, made_again):
    """`rm -r` of the state home under a running daemon (a reset): the daemon must not schedule
    on from a database already deleted, nor beside the next daemon of a home made again."""
    from scheduler.control import pid_file

    daemon = start_daemon(tmp_path / "daemon.log")  # the log outside the home it loses
    second = None
    try:
        wait_for(pid_file().exists, what="the daemon's pid file")
        shutil.rmtree(home)
        if made_again:
            home.mkdir()
            second = start_daemon(tmp_path / "second.log")
            wait_for(pid_file().exists, what="the second daemon's pid file")
        assert daemon.wait(timeout=60) == 1
        log = (tmp_path / "daemon.log").read_text()
        assert f"the state home {home} was removed or replaced while this daemon ran; stopping" in log, log
        assert "Traceback" not in log, log
        if second:
            assert second.poll() is None, (tmp_path / "second.log").read_text()  # the new home's daemon goes on
    finally:
        stop_process(daemon)
        if second:
            stop_process(second)



@pytest.mark.parametrize("made_again", [False, True], ids=["removed", "removed-and-made-again"])
def test_a_supervisor_whose_state_home_is_removed_gives_up_at_its_jobs_end(state_home, tmp_path, monkeypatch,
                                                                             made_again):
    """`rm -r` of the state home under a running job: the job runs on to its end, then its
    supervisor says its end cannot be recorded and exits, where it retried every 30 s forever.
    In a home made again, the new database's job of the same id is another job: the old
    supervisor neither writes to it nor takes its cancel."""
    from scheduler import procs

    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    home = state_home
    home.mkdir(parents=True)
    engine = get_engine()
    go = tmp_path / "go"
    job_id = submit(engine, NewJob(name="outlives", kind="command", gpus=1, workdir=str(tmp_path),
                                   stdout=str(tmp_path / "job.out"), argv=[
        "sh", "-c", f'echo up; while [ ! -e {go} ]; do sleep 0.05; done; echo "$SAE_DIST_JOB_ID" > ended']))
    daemon = start_daemon(tmp_path / "daemon.log")  # its log outside the home it loses
    job = None
    try:
        job = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 60, "the job's process to be recorded")
        log = open(home / "logs" / "supervisors.log")  # read after the home is gone, through this handle
        engine.dispose()
        shutil.rmtree(home)
        if made_again:  # a new home, a new database, whose job 1 is another one, then cancelled
            home.mkdir()
            made = subprocess.run([sys.executable, "-m", "scheduler", "submit", "--gpus", "0", "--", "true"],
                                  cwd=REPO, capture_output=True, text=True, timeout=120)
            assert made.returncode == 0 and f"Submitted batch job {job_id}" in made.stdout, made.stdout + made.stderr
            assert subprocess.run([sys.executable, "-m", "scheduler", "cancel", str(job_id)], cwd=REPO,
                                  capture_output=True, timeout=120).returncode == 0
        # The supervisor sees the loss at its first poll after the removal, before any read: it
        # never took the new job's cancel. Its job runs on, and ends when told to.
        seen: list[str] = []
        wait_for(lambda: seen.append(log.read()) or "the job runs on to its end" in "".join(seen), 60,
                 "the supervisor to see its database gone")
        assert procs.is_alive(job.pid, job.proc_start_ticks)
        go.touch()
        wait_for(lambda: not procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks), 60,
                 "the supervisor to give up")
        assert (tmp_path / "ended").read_text().strip() == str(job_id)
        text = "".join(seen) + log.read()
        log.close()
        assert f"job {job_id} ended COMPLETED (exit 0); not recorded: its state database was removed or " \
               "replaced while it ran" in text, text
        assert "Traceback" not in text, text
        assert not (home / "jobs").exists()  # nothing kept in a home that is not its own
        if made_again:
            assert get_job(get_engine(), job_id).pid is None  # the new job 1 never got its process
    finally:
        stop_process(daemon)
        for pid, ticks in ((job.pid, job.proc_start_ticks), (job.supervisor_pid, job.supervisor_start_ticks)) \
                if job else ():
            if procs.is_alive(pid, ticks):
                os.kill(pid, signal.SIGKILL)

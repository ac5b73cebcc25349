"""The scheduler for real: a daemon process, supervisors, jobs, SIGKILLs, 4 virtual devices."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import REPO, kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from sae_dist.db import Allocation, get_engine
from scheduler import procs
from scheduler.store import NewJob, get_job, list_jobs, submit, submit_many

DEVICES = 4

pytestmark = pytest.mark.slow  # a real daemon, supervisors and jobs in every test


@pytest.fixture
def sched(state_home, monkeypatch):
    """A state home with 4 virtual devices and a helper to run daemons in it."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", str(DEVICES))
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")  # tests start their daemon themselves
    monkeypatch.setenv("SAE_DIST_KILL_GRACE_S", "3")
    started: list[subprocess.Popen] = []

    class Sched:
        home = state_home

        def start_daemon(self) -> subprocess.Popen:
            state_home.mkdir(parents=True, exist_ok=True)
            proc = start_daemon(state_home / "daemon-test.log")
            started.append(proc)
            return proc

    yield Sched()
    for proc in started:
        stop_process(proc)
    # No job of a test outlives it.
    kill_running_jobs()


def job(*argv: str, gpus: int = 1, **fields) -> NewJob:
    return NewJob(name=fields.pop("name", Path(argv[0]).name), kind="command", argv=list(argv), gpus=gpus,
                  workdir=str(REPO), **fields)


def gated(gate: Path, exit_code: int = 0, **fields) -> NewJob:
    """A job that runs until the test creates `gate`, then exits with exit_code: it is still running
    at every check the test makes before, however slow the machine."""
    return job("sh", "-c", f'while [ ! -e "{gate}" ]; do sleep 0.05; done; exit {exit_code}', name="gated", **fields)


def state(job_id: int) -> str:
    return get_job(get_engine(), job_id).state


def wait_state(job_id: int, states, timeout: float = 60):
    states = {states} if isinstance(states, str) else set(states)
    try:
        wait_for(lambda: state(job_id) in states, timeout, f"job {job_id} to be {states}")
    except AssertionError as e:  # the state it was left in, at the end of the wait
        ended = get_job(get_engine(), job_id)
        raise AssertionError(f"{e}: it is {ended.state} ({ended.reason})") from None
    return get_job(get_engine(), job_id)


def started(job_id: int):
    """The job once its supervisor has started its process (both recorded), as a row."""
    return wait_for(lambda: (j := get_job(get_engine(), job_id)).pid and j.supervisor_pid and j, 60,
                    f"job {job_id}'s supervisor and process")


def active_devices() -> dict[str, int]:
    from scheduler.store import active_allocations

    with get_engine().connect() as conn:
        return active_allocations(conn)


PER_WORKER = 20  # 8 x 20 submits, started together (forked): the writers overlap for all of their run


def _submitter(worker: int, out) -> None:
    """One writer, in a process forked from this one (the imports are done: a fresh interpreter
    spent ~1 s CPU on them, 8 of them beside each other on a loaded machine took most of the test)."""
    engine = get_engine()
    engine.dispose(close=False)  # the parent's pooled connections stay the parent's: none crosses the fork
    out.send([submit(engine, NewJob(name=f"w{worker}-{i}", kind="command", argv=["true"], gpus=1, workdir="/",
                                    held=True)) for i in range(PER_WORKER)])
    out.close()


def test_eight_concurrent_submitters_lose_nothing(sched):
    import multiprocessing

    get_engine()  # migrate once, before the crowd
    fork = multiprocessing.get_context("fork")
    pipes = [fork.Pipe(duplex=False) for _ in range(8)]
    workers = [fork.Process(target=_submitter, args=(w, send)) for w, (_, send) in enumerate(pipes)]
    for w in workers:
        w.start()
    ids = []
    for w, (receive, _) in zip(workers, pipes):
        assert receive.poll(120), f"writer {w.name} sent nothing"
        ids += receive.recv()
        w.join(30)
        assert w.exitcode == 0
    assert len(ids) == 8 * PER_WORKER and len(set(ids)) == 8 * PER_WORKER
    names = {j.name for j in list_jobs(get_engine())}
    assert names == {f"w{w}-{i}" for w in range(8) for i in range(PER_WORKER)}


def test_80_short_jobs_never_share_a_device(sched):
    rng = random.Random(7)
    engine = get_engine()
    ids = submit_many(engine, [job("true", gpus=rng.randint(1, 3), name=f"short{i}") for i in range(80)])
    sched.start_daemon()
    wait_for(lambda: all(j.state == "COMPLETED" for j in list_jobs(engine)), 200, "80 jobs to complete")
    from sqlmodel import Session, select

    with Session(engine) as s:
        allocations = s.exec(select(Allocation)).all()
    assert {a.job_id for a in allocations} == set(ids)
    by_device: dict[str, list[tuple]] = {}
    for a in allocations:
        assert a.released_at is not None
        by_device.setdefault(a.device_uuid, []).append((a.allocated_at, a.released_at, a.job_id))
    for device, spans in by_device.items():
        spans.sort()
        for (_, end, job_a), (start, _, job_b) in zip(spans, spans[1:]):
            assert start >= end, f"{device}: job {job_b} started before job {job_a} released it"
    assert all(len(json.loads(j.devices_json)) == j.gpus for j in list_jobs(engine))


def test_jobs_survive_a_sigkilled_daemon(sched):
    engine = get_engine()
    gate = sched.home / "gate"
    fail = submit(engine, gated(gate, exit_code=3))
    ok = submit(engine, gated(gate))
    daemon = sched.start_daemon()
    # Running means started by a supervisor: the jobs read RUNNING a moment before the daemon
    # forks their supervisors, and a job whose daemon dies in that moment never runs (NODE_FAIL).
    started(fail)
    started(ok)
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    assert state(fail) == "RUNNING"  # the job does not depend on the daemon
    successor = sched.start_daemon()  # a new daemon adopts what runs (the supervisors hold no lock)
    time.sleep(1.5)
    assert successor.poll() is None, (sched.home / "daemon-test.log").read_text()[-2000:]
    assert state(fail) == "RUNNING"
    gate.touch()
    failed = wait_state(fail, "FAILED", 30)
    completed = wait_state(ok, "COMPLETED", 30)
    assert failed.exit_code == 3 and completed.exit_code == 0
    assert active_devices() == {}


def test_a_supervisor_its_dead_daemon_did_not_record_is_adopted(sched):
    """A daemon SIGKILLed right after forking a supervisor: the supervisor registers itself, so
    the next daemon's pass, long after the start, sees it alive and leaves its job running (it
    used to end it as NODE_FAIL, killing a healthy job)."""
    from datetime import timedelta

    from sae_dist.db import utcnow
    from scheduler.daemon import Daemon
    from scheduler.store import start_jobs

    engine = get_engine()
    gate = sched.home / "gate"
    job_id = submit(engine, gated(gate))
    long_ago = utcnow() - timedelta(seconds=70)
    assert [s[0] for s in start_jobs(engine, [(job_id, ("virtual-0",))], {}, now=long_ago)] == [job_id]
    # The supervisor as the dead daemon left it: running, with nobody to record its pid.
    supervisor = subprocess.Popen([sys.executable, "-m", "scheduler.supervisor", str(job_id)], cwd=REPO,
                                  start_new_session=True)
    try:
        running = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 30, "the job's process")
        assert running.supervisor_pid == supervisor.pid
        assert procs.is_alive(running.supervisor_pid, running.supervisor_start_ticks)
        Daemon(engine).scheduling_pass()
        assert state(job_id) == "RUNNING"
        gate.touch()
        assert wait_state(job_id, "COMPLETED", 30).exit_code == 0
        assert supervisor.wait(30) == 0
    finally:
        gate.touch()


def test_no_sqlite_connection_crosses_the_fork_of_a_supervisor(sched, monkeypatch):
    """A supervisor forked with the daemon's SQLite connections open inherits SQLite's lock
    bookkeeping for the file; after a SIGKILLed daemon that left a job RUNNING forever (CI)."""
    from scheduler.daemon import Daemon

    engine = get_engine()
    job_id = submit(engine, job("true"))
    open_at_fork = []
    real_fork = os.fork

    def fork():
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        open_at_fork.append([t for t in targets if t.startswith(str(sched.home.resolve() / "state.db"))])
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    assert Daemon(engine).scheduling_pass() == [job_id]
    assert open_at_fork == [[]]
    assert wait_state(job_id, "COMPLETED", 30).exit_code == 0


def test_sigkilled_supervisor_is_node_fail_and_frees_devices(sched):
    engine = get_engine()
    job_id = submit(engine, job("sleep", "300", gpus=2))
    sched.start_daemon()
    running = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 30, "the job's process")
    os.kill(running.supervisor_pid, signal.SIGKILL)
    ended = wait_state(job_id, "NODE_FAIL", 10)
    assert "supervisor" in ended.reason
    assert active_devices() == {}
    assert not procs.is_alive(running.pid, running.proc_start_ticks)  # nothing holds the devices


def test_stopping_the_daemon_by_name_spares_the_jobs(sched):
    """`pkill -f "scheduler daemon"` reads /proc/PID/cmdline: a supervisor forked from the daemon
    names itself, so only the daemon matches (every job's supervisor did, and 4 of 4 jobs ended
    NODE_FAIL). Checked on the lines pkill reads, not with pkill: other tests' daemons run beside."""
    job_id = submit(get_engine(), job("sleep", "300"))
    daemon = sched.start_daemon()
    running = started(job_id)

    def cmdline(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    assert "scheduler daemon" in cmdline(daemon.pid)
    supervisor = cmdline(running.supervisor_pid)
    assert "scheduler daemon" not in supervisor and f"sae-dist supervisor of job {job_id}" in supervisor
    stop_process(daemon)  # what pkill -f would have hit
    assert state(job_id) == "RUNNING" and procs.is_alive(running.pid, running.proc_start_ticks)


def test_why_a_job_ended_is_one_line_for_the_listings():
    """SLURM's Reason: a failure's last line of error output (it was only in the log), a stop
    nobody asked for through the scheduler, a time limit. (A cancel by the user is named so where
    the end is stored: test_scheduler_final_state.)"""
    from scheduler.supervisor import FAILURE_REASON_CHARS, end_reason

    tail = "step 0\nTraceback (most recent call last):\n  ...\nerror: run directory /r already exists\n\n"
    assert end_reason("FAILED", tail, None) == "error: run directory /r already exists"
    assert end_reason("OUT_OF_MEMORY", "CUDA out of memory. Tried to allocate 2 GiB", None).startswith("CUDA")
    assert end_reason("FAILED", "", None) is None  # nothing said: nothing invented
    assert len(end_reason("FAILED", "x" * 1000, None)) == FAILURE_REASON_CHARS
    assert end_reason("CANCELLED", "", signal.SIGTERM) == "Stopped by SIGTERM to its supervisor, not by a cancel"
    assert end_reason("TIMEOUT", tail, None) == "Time limit reached"
    assert end_reason("COMPLETED", tail, None) is None


def test_a_failed_job_says_why_in_acct_and_the_queue(sched, tmp_path):
    engine = get_engine()
    job_id = submit(engine, job("sh", "-c", "echo starting; echo 'error: the data is gone' >&2; exit 3"))
    sched.start_daemon()
    ended = wait_state(job_id, "FAILED", 30)
    assert (ended.exit_code, ended.reason) == (3, "error: the data is gone")
    acct = run_cli("acct", "-j", str(job_id), module="scheduler")
    assert acct.returncode == 0 and "REASON" in acct.stdout.splitlines()[0]
    assert acct.stdout.splitlines()[1].rstrip().endswith("error: the data is gone"), acct.stdout
    listed = json.loads(run_cli("queue", "--all", "--json", module="scheduler").stdout)
    assert [j["reason"] for j in listed if j["job_id"] == job_id] == ["error: the data is gone"]


def test_sigkilled_job_is_failed_with_its_signal(sched):
    engine = get_engine()
    job_id = submit(engine, job("sleep", "300"))
    sched.start_daemon()
    running = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 30, "the job's process")
    os.kill(running.pid, signal.SIGKILL)
    ended = wait_state(job_id, "FAILED", 10)
    assert ended.signal == signal.SIGKILL and ended.exit_code is None
    assert active_devices() == {}


def submit_endless_two_rank_training(tmp_path: Path, name: str, d_in: int, d_sae: int, batch_size: int) -> int:
    """A 2-rank training of a million steps (it runs until the test stops it), through the CLI."""
    (tmp_path / "run.toml").write_text(textwrap.dedent(f"""
        d_in = {d_in}
        d_sae = {d_sae}
        k = 8
        batch_size = {batch_size}
        steps = 1000000
        log_every = 50
        checkpoint_every = 0
        out_dir = "{tmp_path / 'run'}"
    """))
    result = run_cli("submit", "--gpus", "2", "--train", str(tmp_path / "run.toml"), "-J", name, module="scheduler")
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


def test_cancel_two_rank_training_leaves_no_process(sched, tmp_path):
    job_id = submit_endless_two_rank_training(tmp_path, "ddp", 32, 128, 64)
    sched.start_daemon()
    engine = get_engine()
    wait_for(lambda: (j := get_job(engine, job_id)).pid and len(procs.descendants(j.pid)) >= 2, 60,
             "the launcher and its 2 ranks")
    from sqlmodel import Session, select

    from sae_dist.db import StepMetric, TrainingRun

    def run_row(s: Session):
        return s.exec(select(TrainingRun).where(TrainingRun.job_id == job_id)).first()

    def training_logged() -> bool:  # the ranks are in the training loop, past their start-up
        with Session(engine) as s:
            run = run_row(s)
            return run is not None and s.exec(select(StepMetric).where(StepMetric.run_id == run.id)).first() is not None

    wait_for(training_logged, 90, "the first logged step")
    running = get_job(engine, job_id)
    tree = [running.pid, *procs.descendants(running.pid)]
    # two ranks in one gloo process group (forked CPU ranks keep the launcher's /proc environ)
    assert len([p for p in tree
                if any("gloo" in comm.read_text() for comm in Path(f"/proc/{p}/task").glob("*/comm"))]) == 2
    assert json.loads(running.devices_json) == ["virtual-0", "virtual-1"]
    result = run_cli("cancel", str(job_id), module="scheduler")
    assert result.returncode == 0, result.stderr
    ended = wait_state(job_id, "CANCELLED", 30)
    assert ended.reason == "Cancelled by user"
    assert procs.wait_gone(tree, 5), f"left running: {[p for p in tree if procs.is_alive(p, None)]}"
    assert active_devices() == {}
    # The training says it was stopped, in its log and its run, without a traceback.
    log = Path(ended.stdout_path).read_text()
    assert "training stopped by SIGTERM" in log and "Traceback" not in log, log[-3000:]
    assert log.count("training stopped by SIGTERM") == 1, log[-3000:]
    with Session(engine) as s:
        run = run_row(s)
    assert run.status == "STOPPED" and "SIGTERM" in run.error and run.finished_at is not None


@pytest.mark.slow
def test_each_rank_of_a_two_device_job_is_counted_on_its_own_device(sched, tmp_path):
    """A 2-rank training on 2 virtual devices: each device's recorded memory is its own rank's
    resident memory (within 20%) and its utilisation its rank's CPU. Forked CPU ranks keep the
    launcher's /proc environ, so all of a job once read as its first device's (virtual-1 at 0 B
    and 0% for the whole job); a rank names itself, and the launcher counts on no device."""
    from sqlmodel import Session, select

    from sae_dist.db import GpuSample
    from scheduler.devices import read_rss

    job_id = submit_endless_two_rank_training(tmp_path, "two", 64, 1024, 256)
    sched.start_daemon()
    engine = get_engine()

    def named_ranks() -> dict[int, int]:
        job = get_job(engine, job_id)
        found = {procs.local_rank(pid): pid for pid in procs.descendants(job.pid)} if job.pid else {}
        return {rank: pid for rank, pid in found.items() if rank is not None}

    ranks = wait_for(lambda: len(named := named_ranks()) == 2 and named, 90, "both ranks, named")
    devices = json.loads(get_job(engine, job_id).devices_json)
    since = time.time()

    def samples() -> dict[str, list]:
        with Session(engine) as s:
            rows = s.exec(select(GpuSample).where(GpuSample.job_id == job_id).order_by(GpuSample.id)).all()
        return {d: [r for r in rows if r.device_uuid == d and r.time.timestamp() > since] for d in devices}

    def three_each() -> dict[str, list] | None:
        got = samples()
        return got if all(len(v) >= 3 for v in got.values()) else None

    wait_for(three_each, 60, "3 samples a device")

    def off_by() -> list:
        """What disagrees, for each device: its latest sample against its rank's resident memory
        read now (a rank's memory still moves while it settles in, so this is waited on, not
        taken once), and its last 3 utilisation samples."""
        seen, wrong = samples(), []
        for rank, device in enumerate(devices):
            rss = read_rss(ranks[rank])
            memory = seen[device][-1].memory_used
            busy = [s.utilization_pct for s in seen[device][-3:]]
            if not (rss and abs(memory - rss) <= 0.2 * rss and max(busy) > 5):
                wrong.append((device, memory, rss, busy))
        return wrong

    last: list = []
    try:
        wait_for(lambda: last.append(off_by()) or not last[-1], 60, "each device to read its own rank's figures")
    except AssertionError as e:
        raise AssertionError(f"{e}: (device, memory, rss, busy) {last[-1]}") from None
    assert run_cli("cancel", str(job_id), module="scheduler").returncode == 0


def test_dependencies(sched):
    engine = get_engine()
    first = submit(engine, job("sh", "-c", "exit 1"))
    after_ok = submit(engine, job("true", dependencies=(("afterok", first),)))
    after_not_ok = submit(engine, job("true", dependencies=(("afternotok", first),)))
    after_any = submit(engine, job("true", dependencies=(("afterany", first),)))
    sched.start_daemon()
    assert wait_state(first, "FAILED").exit_code == 1
    wait_state(after_not_ok, "COMPLETED")
    wait_state(after_any, "COMPLETED")
    wait_for(lambda: get_job(engine, after_ok).reason == "DependencyNeverSatisfied", 10, "never satisfied")
    assert state(after_ok) == "PENDING"


def test_hold_release_and_requeue(sched, tmp_path, capsys):
    """release and requeue as real processes; hold's refusal through the same main() in this process."""
    from test_scheduler_cli import cli_in_process

    engine = get_engine()
    held = submit(engine, job("true", held=True))
    marker = tmp_path / "tried"
    # fails the first time, succeeds when requeued
    flaky = submit(engine, job("sh", "-c", f"test -e {marker} || {{ touch {marker}; exit 4; }}", requeue=True))
    sched.start_daemon()
    done = wait_state(flaky, "COMPLETED", 30)
    assert done.requeue_count == 1 and done.exit_code == 0
    time.sleep(1.5)
    assert state(held) == "PENDING" and get_job(engine, held).reason == "JobHeldUser"
    assert run_cli("release", str(held), module="scheduler").returncode == 0
    wait_state(held, "COMPLETED", 30)
    result = run_cli("requeue", str(held), module="scheduler")
    assert result.returncode == 0 and "requeued" in result.stdout
    assert wait_state(held, "COMPLETED", 30).requeue_count == 1
    bad = cli_in_process(capsys, "hold", str(held))
    assert bad.returncode == 2 and "only PENDING jobs" in bad.stderr


def test_time_limit_ends_in_timeout(sched):
    engine = get_engine()
    job_id = submit(engine, job("sleep", "300", time_limit_s=2.0))
    sched.start_daemon()
    running = wait_for(lambda: (j := get_job(engine, job_id)).pid and j, 30, "the job's process")
    ended = wait_state(job_id, "TIMEOUT", 20)
    assert ended.signal == signal.SIGTERM and ended.reason == "Time limit reached"
    assert not procs.is_alive(running.pid, running.proc_start_ticks)
    assert (ended.ended_at - ended.started_at).total_seconds() < 60  # the limit, not the job's 300 s


def test_backfill_starts_a_short_job_but_not_one_that_would_delay_the_head(sched):
    engine = get_engine()
    long = submit(engine, job("sleep", "120", gpus=3, time_limit_s=120.0, priority=10))
    sched.start_daemon()
    wait_state(long, "RUNNING")
    gate = sched.home / "gate"
    head = submit(engine, gated(gate, gpus=4, priority=5))  # waits for all 4 devices
    endless = submit(engine, job("sleep", "60", gpus=1))  # no limit: would hold the head's device
    short = submit(engine, job("sleep", "1", gpus=1, time_limit_s=30.0))  # done before the head can start
    wait_state(short, {"RUNNING", "COMPLETED"}, 15)
    assert get_job(engine, head).reason == "Resources"
    assert state(endless) == "PENDING" and get_job(engine, endless).reason == "Priority"
    # The head's reservation is its expected start: when the long job's time limit frees its devices.
    expected = get_job(engine, long).started_at + timedelta(seconds=120)
    reserved = wait_for(lambda: get_job(engine, head).expected_start_at, what="the head's expected start")
    assert abs((reserved - expected).total_seconds()) <= 1
    assert get_job(engine, endless).expected_start_at is None
    from scheduler.cli import main  # in this process: cancel as a process is test_cancel_two_rank_training's

    rows = {r["job_id"]: r for r in _queue_json(main, "--start")}
    assert set(rows) == {head, endless} and rows[head]["expected_start"] == reserved.isoformat()
    assert main(["cancel", str(long)]) == 0
    wait_state(head, "RUNNING", 30)
    assert state(endless) == "PENDING"  # after the head, not before it
    # The next head (endless) waits on a job without a time limit: nothing says when.
    wait_for(lambda: all(j.expected_start_at is None for j in list_jobs(engine)), what="no expected start left")
    gate.touch()


def _queue_json(main, *flags: str) -> list[dict]:
    """`queue --json FLAGS` in this process."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["queue", "--json", *flags]) == 0
    return json.loads(out.getvalue())


def test_one_daemon_per_state_directory(sched):
    first = sched.start_daemon()
    from scheduler.control import daemon_running

    wait_for(daemon_running, 20, "the first daemon")
    second = run_cli("daemon", module="scheduler", timeout=30)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        f"error: a scheduler daemon already runs for {sched.home} (see {sched.home / 'daemon.pid'})"]
    assert first.poll() is None


def test_daemon_detach_and_stop(sched, capsys):
    """`daemon --detach` starts one in the background (once); `daemon --stop` ends it, not its jobs.
    The start and the stop are real processes; the two answers of nothing to do come from the same
    main() in this process."""
    from scheduler.control import daemon_running
    from test_scheduler_cli import cli_in_process

    started = run_cli("daemon", "--detach", module="scheduler", timeout=30)
    assert started.returncode == 0 and "daemon started" in started.stdout, started.stderr
    wait_for(daemon_running, 20, "the detached daemon")
    again = cli_in_process(capsys, "daemon", "--detach")
    assert again.returncode == 0 and "already runs" in again.stdout
    gate = sched.home / "gate"
    job_id = submit(get_engine(), gated(gate))
    wait_state(job_id, "RUNNING", 30)  # the daemon wakes every second
    stopped = run_cli("daemon", "--stop", module="scheduler", timeout=30)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert not daemon_running()
    assert state(job_id) == "RUNNING"  # the job carries on without the daemon
    gate.touch()
    assert wait_state(job_id, "COMPLETED", 30).exit_code == 0
    none = cli_in_process(capsys, "daemon", "--stop")
    assert none.returncode == 0 and "no daemon runs" in none.stdout

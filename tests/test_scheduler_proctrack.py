"""Process tracking that nothing escapes: a job's processes, detached (setsid, double fork) or
not, end with the job, also when its supervisor is SIGKILLed, and its devices are freed only
once the last of them is gone. Each job runs in a cgroup v2 of its own where cgroup v2 is
writable (those tests skip, saying why, where it is not); the fallback (SAE_DIST_CGROUPS=0: the
supervisor as child subreaper, and the job's mark in every process's environment) runs
everywhere. The decisions are tested first, on plain data."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, kill_running_jobs, start_daemon, stop_process, wait_for
from sae_dist.db import get_engine
from scheduler import cgroups, procs, proctrack
from scheduler.store import NewJob, active_allocations, cancel, get_job, list_jobs, submit, submit_many

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


# ---- the decisions, on plain data ----

HYBRID_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_the_cgroup2_mount_is_read_from_the_mount_table():
    assert proctrack.cgroup2_mount(HYBRID_MOUNTS) == "/sys/fs/cgroup/unified"  # hybrid layout
    assert proctrack.cgroup2_mount("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n") == "/sys/fs/cgroup"  # unified
    assert proctrack.cgroup2_mount("cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\n") == "/mnt/my cgroups"
    assert proctrack.cgroup2_mount(HYBRID_MOUNTS.replace("cgroup2", "cgroup")) is None  # v1 only


def test_a_process_cgroup_is_its_0_line():
    assert proctrack.own_cgroup("4:memory:/x\n1:cpu:/\n0::/sae-dist-ab/job-3\n") == "/sae-dist-ab/job-3"
    assert proctrack.own_cgroup("4:memory:/x\n") is None  # v1 only


def test_which_tracking_a_job_can_have():
    assert proctrack.why_not_cgroups(None, 0, "/sys/fs/cgroup") is None
    assert proctrack.why_not_cgroups("1", 0, "/sys/fs/cgroup") is None
    assert proctrack.why_not_cgroups("0", 0, "/sys/fs/cgroup") == "SAE_DIST_CGROUPS=0"
    assert proctrack.why_not_cgroups(None, 1000, "/sys/fs/cgroup") == "not root"
    assert proctrack.why_not_cgroups(None, 0, None) == "no cgroup2 mount"
    assert proctrack.describe("/c/job-3", None) == "processes tracked in cgroup /c/job-3"
    assert proctrack.describe(None, "not root") == ("processes tracked by its supervisor as child subreaper and by "
                                                    "SAE_DIST_JOB_MARK (no cgroup: not root)")


def test_names_of_state_directories_and_jobs():
    a, b = proctrack.state_key("/home/a/.sae_dist"), proctrack.state_key("/home/b/.sae_dist")
    assert a != b and len(a) == 12 and a == proctrack.state_key("/home/a/.sae_dist")
    assert proctrack.parent_name(a) == f"sae-dist-{a}"
    assert proctrack.job_id_of(proctrack.job_name(17)) == 17
    assert [proctrack.job_id_of(n) for n in ("job-", "job-x", "jobs-3", "cgroup.procs")] == [None] * 4
    assert proctrack.job_mark(a, 5) == f"{a}:5"
    assert proctrack.in_a_job_cgroup(f"/sae-dist-{a}/job-3") and proctrack.in_a_job_cgroup(f"/sae-dist-{b}/job-3/x")
    assert not any(map(proctrack.in_a_job_cgroup, ["/", f"/sae-dist-{a}", "/user.slice/job-3", None]))


def test_a_mark_is_read_from_an_environ():
    environ = b"PATH=/bin\0SAE_DIST_JOB_MARK=ab:3\0SAE_DIST_JOB_MARKX=no\0"
    assert proctrack.mark_of(environ, "SAE_DIST_JOB_MARK") == "ab:3"
    assert proctrack.mark_of(b"PATH=/bin\0", "SAE_DIST_JOB_MARK") is None


def test_a_job_has_ended_when_its_cgroup_is_empty_and_nothing_else_is_found():
    assert proctrack.populated("populated 1\nfrozen 0\n") and not proctrack.populated("populated 0\nfrozen 0\n")
    assert proctrack.all_gone(False, []) and proctrack.all_gone(None, [])
    assert not proctrack.all_gone(True, []) and not proctrack.all_gone(False, [12])
    assert not proctrack.all_gone(None, [12])


def test_a_vanished_supervisors_job_is_signalled_a_step_a_pass():
    assert proctrack.kill_signal(None, 100.0, 5.0) == signal.SIGTERM  # the first look
    assert proctrack.kill_signal(100.0, 104.9, 5.0) is None  # its grace
    assert proctrack.kill_signal(100.0, 105.0, 5.0) == signal.SIGKILL
    assert proctrack.kill_signal(100.0, 200.0, 5.0) == signal.SIGKILL  # again, every pass, until gone


def test_an_empty_cgroup_is_believed_at_once_nothing_found_without_one_after_a_second():
    """A process its supervisor forked just before dying: with a cgroup, it is in the cgroup
    before it runs anything (or, the cgroup removed, runs nothing); without, it carries the job's
    mark only once it exec'd the job, so "nothing found" must hold for SETTLE_S."""
    assert proctrack.orphan_ended(False, [], None, 100.0)
    assert not proctrack.orphan_ended(True, [], None, 100.0) and not proctrack.orphan_ended(False, [7], 90.0, 100.0)
    assert not proctrack.orphan_ended(None, [], None, 100.0)
    assert not proctrack.orphan_ended(None, [], 100.0, 100.0 + proctrack.SETTLE_S / 2)
    assert proctrack.orphan_ended(None, [], 100.0, 100.0 + proctrack.SETTLE_S)
    assert not proctrack.orphan_ended(None, [7], 100.0, 200.0)


def test_what_is_stale_at_a_daemons_start():
    names = ["cgroup.procs", "job-3", "job-4", "job-12", "notes"]
    assert proctrack.stale_jobs(names, {4}) == [3, 12]
    assert proctrack.stale_jobs(names, {3, 4, 12}) == []
    assert proctrack.stale_marks({3: [100, 101], 4: [102], 5: []}, {4}) == {3: [100, 101]}


# ---- real jobs ----

def cgroups_unwritable() -> str | None:
    """Why the cgroup tests cannot run here, or None (root, a cgroup2 mount we may write)."""
    why = cgroups.why_not()
    if why is not None:
        return f"cgroup v2 is not usable here ({why})"
    probe = cgroups.mount() / f"sae-dist-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cgroup v2 is not writable here: cannot create {probe} ({e.strerror})"
    return None


CGROUPS_UNWRITABLE = cgroups_unwritable()
needs_cgroups = pytest.mark.skipif(CGROUPS_UNWRITABLE is not None, reason=str(CGROUPS_UNWRITABLE))

# A job that detaches a child (setsid, double fork) that sleeps 600 s, the way a daemon starts:
# the child records "device pid start-ticks" in pids/<job>. At its start the job writes down any
# child of another job still alive on its device (overlapping use), and its own cgroup.
DETACHING_JOB = textwrap.dedent("""
    import os, signal, sys, time
    out, hold, stubborn = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "stubborn"
    job, device = os.environ["SAE_DIST_JOB_ID"], os.environ["SAE_DIST_DEVICES"]
    pids = os.path.join(out, "pids")

    def alive(pid, ticks):
        try:
            stat = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except OSError:
            return False
        return stat[19] == ticks and stat[0] != "Z"

    def append(name, line):
        with open(os.path.join(out, name), "a") as f:
            f.write(line + "\\n")

    for name in os.listdir(pids):
        try:
            dev, pid, ticks = open(os.path.join(pids, name)).read().split()
        except (OSError, ValueError):
            continue
        if dev == device and name != job and alive(pid, ticks):
            append("overlaps", f"job {job} started on {device} while job {name}'s process {pid} lived")
    own = [line[3:] for line in open("/proc/self/cgroup").read().splitlines() if line.startswith("0::")]
    append("cgroups", f"{job} {own[0] if own else '-'}")
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if stubborn:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # sleep inherits it
            ticks = open("/proc/self/stat").read().rpartition(")")[2].split()[19]
            with open(os.path.join(pids, "." + job), "w") as f:
                f.write(f"{device} {os.getpid()} {ticks}")
            os.rename(os.path.join(pids, "." + job), os.path.join(pids, job))
            os.execvp("sleep", ["sleep", "600"])
        os._exit(0)
    os.wait()
    while not os.path.exists(os.path.join(pids, job)):
        time.sleep(0.01)
    print("detached", flush=True)
    time.sleep(hold)
""")


@pytest.fixture
def out(state_home, monkeypatch, tmp_path):
    """3 virtual devices, no autostart; a folder for the jobs' records (pids/, overlaps, cgroups)."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "3")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_KILL_GRACE_S", "3")
    state_home.mkdir(parents=True, exist_ok=True)
    folder = tmp_path / "out"
    (folder / "pids").mkdir(parents=True)
    (folder / "job.py").write_text(DETACHING_JOB)
    yield folder
    kill_running_jobs()
    for pid, ticks in recorded(folder).values():  # nothing a test started outlives it, failed or not
        if procs.is_alive(pid, ticks):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fallback(monkeypatch):
    monkeypatch.setenv(proctrack.CGROUPS_ENV, "0")


def detaching(out: Path, hold: float, stubborn: bool = False) -> NewJob:
    return NewJob(name="detach", kind="command", gpus=1, workdir=str(out),
                  argv=[sys.executable, str(out / "job.py"), str(out), f"{hold:.2f}", "stubborn" if stubborn else "-"])


def recorded(out: Path) -> dict[int, tuple[int, int]]:
    """job id -> (pid, start ticks) of the child each job detached."""
    found = {}
    for path in (out / "pids").iterdir():
        if not path.name.startswith("."):
            _, pid, ticks = path.read_text().split()
            found[int(path.name)] = (int(pid), int(ticks))
    return found


def living(out: Path) -> dict[int, int]:
    """job id -> pid of each detached child still alive."""
    return {job_id: pid for job_id, (pid, ticks) in recorded(out).items() if procs.is_alive(pid, ticks)}


def job_cgroup_names() -> list[str]:
    return [n for n in cgroups.job_cgroups() if proctrack.job_id_of(n) is not None]


def supervisor_log(home: Path) -> str:
    path = home / "logs" / "supervisors.log"
    return path.read_text() if path.exists() else ""


def wait_final(job_id: int, timeout: float = 60):
    engine = get_engine()
    return wait_for(lambda: (j := get_job(engine, job_id)).state in FINAL and j, timeout, f"job {job_id} to end")


def detached(out: Path, job_id: int) -> int:
    return wait_for(lambda: living(out).get(job_id), 60, f"job {job_id}'s detached child")


def run_one(out: Path, state_home: Path, hold: float, stubborn: bool = False):
    """Submit one detaching job, start a daemon; returns (engine, job id, daemon)."""
    engine = get_engine()
    job_id = submit(engine, detaching(out, hold, stubborn))
    return engine, job_id, start_daemon(state_home / "daemon-test.log")


@needs_cgroups
@pytest.mark.slow
def test_a_detached_child_ends_with_its_job_whose_cgroup_held_it(out, state_home):
    engine, job_id, daemon = run_one(out, state_home, hold=0.0)
    try:
        ended = wait_final(job_id)
    finally:
        stop_process(daemon)
    assert ended.state == "COMPLETED", ended
    assert job_id in recorded(out) and living(out) == {}
    # Its first process was in its cgroup before it ran a line; the cgroup is gone with the job.
    parent = f"/{proctrack.parent_name(cgroups.home_key())}"
    assert (out / "cgroups").read_text() == f"{job_id} {parent}/job-{job_id}\n"
    assert job_cgroup_names() == []
    assert f"job {job_id}: processes tracked in cgroup {cgroups.mount()}{parent}/job-{job_id}" in \
        supervisor_log(state_home)


@needs_cgroups
@pytest.mark.slow
def test_a_cancel_ends_every_process_in_the_cgroup(out, state_home):
    engine, job_id, daemon = run_one(out, state_home, hold=600)
    try:
        child = detached(out, job_id)
        assert cgroups.cgroup_of(child) == f"/{proctrack.parent_name(cgroups.home_key())}/job-{job_id}"
        assert cancel(engine, job_id) == "requested"
        ended = wait_final(job_id)
    finally:
        stop_process(daemon)
    assert (ended.state, ended.reason) == ("CANCELLED", "Cancelled by user")
    assert living(out) == {} and job_cgroup_names() == []


@needs_cgroups
@pytest.mark.slow
def test_a_killed_supervisors_devices_are_freed_only_once_its_cgroup_is_empty(out, state_home):
    """The supervisor SIGKILLed, the detached child ignores SIGTERM: each pass signals and moves
    on, the device stays held while the child lives, cgroup.kill after the grace, then NODE_FAIL
    and the cgroup removed."""
    from scheduler.daemon import KILL_GRACE_S, Daemon

    engine = get_engine()
    job_id = submit(engine, detaching(out, 600, stubborn=True))
    daemon = Daemon(engine)
    assert daemon.scheduling_pass() == [job_id]
    child = detached(out, job_id)
    job = get_job(engine, job_id)
    os.kill(job.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: not procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks) or daemon._reap_children(),
             30, "the supervisor to die")
    path = cgroups.job_path(job_id)
    now = time.time()
    assert [j.id for j in daemon._reap(running(engine), now)] == [job_id]  # SIGTERM to the whole cgroup
    wait_for(lambda: not procs.is_alive(job.pid, job.proc_start_ticks), 30, "SIGTERM to end the job's main process")
    assert [j.id for j in daemon._reap(running(engine), now + 1)] == [job_id]  # in its grace
    assert allocations(engine) == {"virtual-0": job_id} and cgroups.populated(path) and child in living(out).values()
    daemon._reap(running(engine), now + KILL_GRACE_S)  # cgroup.kill
    wait_for(lambda: not cgroups.populated(path), 30, "cgroup.kill to empty the cgroup")
    assert daemon._reap(running(engine), now + KILL_GRACE_S + 1) == []
    assert allocations(engine) == {} and get_job(engine, job_id).state == "NODE_FAIL"
    assert not path.exists() and living(out) == {}


@needs_cgroups
@pytest.mark.slow
def test_a_job_whose_first_process_cannot_enter_its_cgroup_starts_in_the_fallback(out, state_home, monkeypatch):
    """The child's write to cgroup.procs fails (here: a descriptor it cannot write): it runs
    nothing of the job, the cgroup is removed, and the job starts again with its supervisor as
    subreaper; its detached child still ends with it."""
    from scheduler.daemon import Daemon

    monkeypatch.setattr(cgroups, "entry", lambda path: os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    engine = get_engine()
    job_id = submit(engine, detaching(out, 0.3))
    assert Daemon(engine).scheduling_pass() == [job_id]
    ended = wait_final(job_id)
    started = (out / "cgroups").read_text().splitlines()
    assert ended.state == "COMPLETED" and len(started) == 1  # it started once, out of any job cgroup
    assert not proctrack.in_a_job_cgroup(started[0].split()[1])
    assert job_id in recorded(out) and living(out) == {} and job_cgroup_names() == []


@needs_cgroups
def test_stale_cgroups_of_ended_jobs_are_emptied_and_removed_when_a_daemon_starts(out, state_home):
    """A job cgroup whose job does not run (it ended while no daemon ran, its supervisor unable
    to remove the cgroup) still holding a process: the daemon's first pass kills and removes it;
    a running job's cgroup is left alone."""
    from scheduler.daemon import Daemon

    stale, running_one = cgroups.job_path(41), cgroups.job_path(42)
    for path in (stale, running_one):
        path.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: (stale / "cgroup.procs").write_text("0"))
    try:
        wait_for(lambda: cgroups.populated(stale), 10, "the sleeper in the stale cgroup")
        daemon = Daemon(get_engine())
        daemon._sweep_stale([type("Job", (), {"id": 42})()])
        assert sleeper.wait(10) == -signal.SIGKILL
        assert not stale.exists() and running_one.exists() and daemon.swept
    finally:
        sleeper.kill()
        running_one.rmdir()


def test_processes_with_the_mark_of_an_ended_job_are_killed_when_a_daemon_starts(out, state_home):
    """An orphan (re-parented away from us) carrying the mark of a job that does not run is
    killed at a daemon's first pass; one with another state directory's mark is left alone."""
    from scheduler.daemon import Daemon

    ours, theirs = (orphan_sleeper(proctrack.job_mark(key, 43))
                    for key in (cgroups.home_key(), proctrack.state_key("/elsewhere")))
    try:
        assert procs.marked(cgroups.home_key()) == {43: [ours[0]]}
        Daemon(get_engine())._sweep_stale([])
        wait_for(lambda: not procs.is_alive(*ours), 10, "the marked orphan to be killed")
        assert procs.is_alive(*theirs)
    finally:
        for pid, ticks in (ours, theirs):
            if procs.is_alive(pid, ticks):
                os.kill(pid, signal.SIGKILL)


def orphan_sleeper(mark: str) -> tuple[int, int]:
    """A `sleep 600` whose parent exited (it is not our child), with SAE_DIST_JOB_MARK=mark:
    (pid, start ticks)."""
    done = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                          env={**os.environ, "SAE_DIST_JOB_MARK": mark}, timeout=30)
    pid = int(done.stdout)
    return pid, wait_for(lambda: procs.start_ticks(pid), 10, "the sleeper")


@needs_cgroups
def test_a_daemon_started_inside_a_job_leaves_the_jobs_cgroup(state_home):
    """A job's `submit` autostarts a daemon inside the job's cgroup: the daemon moves to the
    state directory's parent cgroup, so the job's end does not end it and its supervisors."""
    path = cgroups.job_path(44)
    path.mkdir(parents=True)
    code = "from scheduler import cgroups; print(cgroups.leave_job_cgroup()); print(cgroups.cgroup_of('self'))"
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: (path / "cgroup.procs").write_text("0"))
    finally:
        path.rmdir()
    parent = f"/{proctrack.parent_name(cgroups.home_key())}"
    assert done.stdout.split() == [f"{parent}/job-44", parent], done.stderr


def test_the_fallback_leaves_out_what_a_daemon_started_inside_the_job_runs(state_home):
    """Below a job's root: its own processes (its mark, or none: a process may clear its
    environment) are the job's; a daemon its `submit` autostarted (marked empty) is not, and
    neither is anything below it (the daemon's supervisors and their jobs, marked as theirs)."""
    from scheduler.tracking import JobProcesses

    mark = proctrack.job_mark(cgroups.home_key(), 5)
    script = ("sleep 600 & env -u SAE_DIST_JOB_MARK sleep 600 & "
              "SAE_DIST_JOB_MARK= sh -c 'SAE_DIST_JOB_MARK=other:6 sleep 600 & wait' & wait")
    root = subprocess.Popen(["sh", "-c", script], env={**os.environ, "SAE_DIST_JOB_MARK": mark})
    try:
        tracked = JobProcesses(5, None, root=root.pid, root_is_job=True)
        wait_for(lambda: len(procs.descendants(root.pid)) == 4, 10, "the processes to start")
        everything = procs.descendants(root.pid)
        marks = sorted(str(procs.job_mark(p)) for p in everything)
        assert marks == sorted(["", mark, "None", "other:6"])
        kept = {procs.job_mark(p) for p in tracked.tree()}
        assert len(tracked.tree()) == 3 and kept == {mark, None}  # the root, its sleep, the unmarked sleep
    finally:
        for pid in procs.descendants(root.pid):
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()


@pytest.mark.slow
def test_fallback_a_detached_child_ends_with_its_job_through_the_subreaper(out, state_home, fallback):
    """SAE_DIST_CGROUPS=0: no cgroup; the setsid'd, double-forked child re-parents to the
    supervisor (its child subreaper), which ends it when the job's main process exits."""
    engine, job_id, daemon = run_one(out, state_home, hold=2.0)
    try:
        child = detached(out, job_id)
        supervisor = str(get_job(engine, job_id).supervisor_pid)
        wait_for(lambda: (procs.stat_fields(child) or [None, None])[1] == supervisor, 30,
                 "the child to re-parent to the supervisor")
        ended = wait_final(job_id)
    finally:
        stop_process(daemon)
    assert ended.state == "COMPLETED" and living(out) == {}
    assert not proctrack.in_a_job_cgroup((out / "cgroups").read_text().split()[1])
    assert job_cgroup_names() == []
    assert f"job {job_id}: processes tracked by its supervisor as child subreaper and by SAE_DIST_JOB_MARK " \
           f"(no cgroup: SAE_DIST_CGROUPS=0)" in supervisor_log(state_home)


@pytest.mark.slow
def test_fallback_a_killed_supervisors_orphan_is_found_by_its_mark(out, state_home, fallback):
    """SAE_DIST_CGROUPS=0 and the supervisor SIGKILLed: the detached child re-parents to init,
    out of every tree; the daemon finds it by SAE_DIST_JOB_MARK in its environment and ends it
    before the job's device is freed."""
    engine, job_id, daemon = run_one(out, state_home, hold=600)
    try:
        child = detached(out, job_id)
        os.kill(get_job(engine, job_id).supervisor_pid, signal.SIGKILL)
        ended = wait_final(job_id)
    finally:
        stop_process(daemon)
    assert ended.state == "NODE_FAIL"
    assert child not in living(out).values()


# ---- chaos ----

def chaos(out: Path, home: Path, jobs: int, kills: int, seed: int) -> tuple[list[int], set[int]]:
    """`jobs` detaching jobs on 3 devices; `kills` of them, picked at random, have their
    supervisor SIGKILLed at a random moment up to 2 s into their run (before the job detached
    its child, while it does, or after; they run 3 s, so every kill lands). Returns (job ids,
    the jobs whose supervisor was killed)."""
    rng = random.Random(seed)
    engine = get_engine()
    targets = set(rng.sample(range(jobs), kills))
    ids = submit_many(engine, [detaching(out, 3.0 if n in targets else rng.uniform(0.2, 1.2)) for n in range(jobs)])
    targets = {ids[n] for n in targets}
    daemon = start_daemon(home / "daemon-test.log")
    kill_at: dict[int, float] = {}
    killed: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while targets - killed and time.monotonic() < deadline:
            for job in list_jobs(engine, ("RUNNING",)):
                if job.id in targets and job.supervisor_pid and job.id not in kill_at:
                    kill_at[job.id] = time.monotonic() + rng.uniform(0, 2.0)
                if job.id in kill_at and job.id not in killed and time.monotonic() >= kill_at[job.id] \
                        and procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks):
                    os.kill(job.supervisor_pid, signal.SIGKILL)
                    killed.add(job.id)
            time.sleep(0.02)
        wait_for(lambda: all(get_job(engine, i).state in FINAL for i in ids), 240, "every job to end")
    finally:
        stop_process(daemon)
    assert killed == targets, f"supervisors of jobs {sorted(targets - killed)} were not killed in time"
    return ids, killed


def check_nothing_escaped(out: Path, home: Path, ids: list[int], killed: set[int]) -> None:
    engine = get_engine()
    ended = {j.id: j.state for j in list_jobs(engine) if j.id in ids}
    healthy = {i: s for i, s in ended.items() if i not in killed}
    assert set(healthy.values()) == {"COMPLETED"}, healthy
    assert {ended[i] for i in killed} <= {"NODE_FAIL", "COMPLETED"}, {i: ended[i] for i in killed}
    assert set(recorded(out)) >= set(healthy)  # every healthy job detached its child
    assert living(out) == {}, "processes outlived their job"
    overlaps = out / "overlaps"
    assert not overlaps.exists(), overlaps.read_text()
    with engine.connect() as conn:
        assert active_allocations(conn) == {}
    assert job_cgroup_names() == []
    logs = [home / "daemon-test.log", home / "logs" / "supervisors.log"]
    assert not [p for p in logs if p.exists() and "Traceback" in p.read_text()]


@needs_cgroups
@pytest.mark.slow
def test_chaos_50_detaching_jobs_10_supervisors_killed_nothing_escapes(out, state_home):
    """50 jobs that each detach a `sleep 600` (setsid, double fork), 10 of their supervisors
    SIGKILLed at random moments: afterwards every detached process is gone, and no job started
    on a device while a process of the job before it there still lived."""
    ids, killed = chaos(out, state_home, jobs=50, kills=10, seed=7)
    check_nothing_escaped(out, state_home, ids, killed)
    cgroup_lines = (out / "cgroups").read_text().split("\n")
    parent = f"/{proctrack.parent_name(cgroups.home_key())}"
    assert all(line.split()[1] == f"{parent}/job-{line.split()[0]}" for line in cgroup_lines if line)


@pytest.mark.slow
def test_chaos_in_the_fallback_nothing_escapes_either(out, state_home, fallback):
    """The same with SAE_DIST_CGROUPS=0, smaller: the orphans of a killed supervisor are found
    by the job's mark."""
    ids, killed = chaos(out, state_home, jobs=20, kills=4, seed=8)
    check_nothing_escaped(out, state_home, ids, killed)


def running(engine) -> list:
    from scheduler.store import running_jobs

    with engine.connect() as conn:
        return running_jobs(conn)


def allocations(engine) -> dict:
    with engine.connect() as conn:
        return active_allocations(conn)

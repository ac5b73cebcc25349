"""One small process per running job: starts it on its devices, waits, records how it ended.

The daemon forks it (`scheduler.daemon`, `_spawn_supervisor`) into a session of its own, so a
daemon crash (even SIGKILL) leaves jobs running and their supervisors still record the real exit
status and free the devices. `python -m scheduler.supervisor JOB_ID` runs one by hand. The job
runs in a cgroup of its own where cgroup v2 is writable, else the supervisor is its child
subreaper (`scheduler.proctrack`): either way, what the job leaves behind, detached or not, is
ended with it, and the job is recorded as ended only once its last process is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sae_dist.contract import (
    ARRAY_JOB_ID_ENV,
    ARRAY_TASK_ID_ENV,
    JOB_ID_ENV,
    JOB_MARK_ENV,
    JOB_NAME_ENV,
    MASTER_PORT_ENV,
    THREADS_PER_RANK_ENV,
    VIRTUAL_DEVICES_ENV,
    device_channels,
)
from sae_dist.contract.sweep_argv import SWEEP_KEY, stored_job_flags
from sae_dist.db import get_engine
from sae_dist.db.schema import PREEMPTED
from sae_dist.paths import run_dir_of, state_home
from scheduler import cgroups, procs, proctrack
from scheduler.devices import VIRTUAL_PREFIX, usable_cores, virtual_count, virtual_device_threads
from scheduler.final_state import FinalState, record_until_stored
from scheduler.snapshot import SNAPSHOT_ENV, SUBMIT_DIR_ENV, release_snapshots
from scheduler.snapshot import root_of as snapshot_root
from scheduler.spec import BATCH, EXPORT_ENV, grace_time
from scheduler.storage_errors import storage_problem
from scheduler.storage_watch import DatabaseWatch
from scheduler.store import array_tasks, claim_supervision, get_job, record_process
from scheduler.tracking import JobProcesses

log = logging.getLogger(__name__)

KILL_GRACE_S = float(os.environ.get("SAE_DIST_KILL_GRACE_S", "30"))  # SIGTERM -> SIGKILL
POLL_S = 0.25  # how often the supervisor looks for a cancel request
RELEASE_WAIT_S = 60.0  # the longest a finished job's supervisor waits to release its snapshot


BARE_ENV_KEPT = ("HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR")
"""What a batch job submitted with --export=NONE keeps of the daemon's environment (with every
SAE_DIST_* variable: the state it belongs to); PATH is then BARE_PATH."""
BARE_PATH = "/usr/local/bin:/usr/bin:/bin"


def job_environment(job, devices: list[str], base: dict[str, str],
                    array_tasks: tuple[int, int, int] | None = None) -> dict[str, str]:
    """The job's environment: ours without SLURM_* (other tools would think SLURM runs them).
    A task of a job array (`array_tasks`: its array's task count, lowest and highest task id)
    also gets SLURM's SLURM_ARRAY_* (a script written for SLURM runs unchanged; they alone do
    not make a tool think SLURM runs it) and ours. A batch script (kind "batch") also gets
    SLURM_JOB_ID, SLURM_JOB_NAME and SLURM_SUBMIT_DIR (stored with it), none of which a tool
    takes for a sign of SLURM's srun (Lightning looks for SLURM_NTASKS, Open MPI for SLURM_JOBID,
    MPICH for SLURM_NODELIST; docs/scheduler.md); with --export=NONE it starts from a bare
    environment (BARE_ENV_KEPT) instead of the daemon's."""
    stored = json.loads(job.env_json or "{}")
    if job.kind == BATCH and stored.get(EXPORT_ENV) == "NONE":
        base = {k: v for k, v in base.items() if k in BARE_ENV_KEPT or k.startswith("SAE_DIST_")}
        base["PATH"] = BARE_PATH
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    if job.array_job_id is not None and array_tasks is not None:
        count, lowest, highest = array_tasks
        env.update({ARRAY_JOB_ID_ENV: str(job.array_job_id), ARRAY_TASK_ID_ENV: str(job.array_task_id),
                    "SLURM_ARRAY_JOB_ID": str(job.array_job_id), "SLURM_ARRAY_TASK_ID": str(job.array_task_id),
                    "SLURM_ARRAY_TASK_COUNT": str(count), "SLURM_ARRAY_TASK_MIN": str(lowest),
                    "SLURM_ARRAY_TASK_MAX": str(highest)})
    kind = _device_kind(devices)
    # Real GPUs by UUID (indices shift when CUDA_VISIBLE_DEVICES is set); none for virtual ones.
    env.update(device_channels(devices, kind)[0])
    env.update({
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        JOB_ID_ENV: str(job.id),
        JOB_MARK_ENV: proctrack.job_mark(cgroups.home_key(), job.id),
        JOB_NAME_ENV: job.name,
        VIRTUAL_DEVICES_ENV: "1" if kind == "cpu" and devices else "0",
    })
    if job.port:
        env[MASTER_PORT_ENV] = str(job.port)
    if kind == "cpu" and devices and THREADS_PER_RANK_ENV not in base:  # the operator's own setting wins
        env[THREADS_PER_RANK_ENV] = str(virtual_device_threads(usable_cores(), virtual_count()))
    if job.snapshot_dir:  # submit --snapshot: Python imports the queued copy first
        root = str(snapshot_root(job.snapshot_dir))
        env.update({SNAPSHOT_ENV: root, SUBMIT_DIR_ENV: job.workdir,
                    "PYTHONPATH": os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)})
    if job.kind == BATCH:  # a task of an array: its own id, as SLURM's (the array's is SLURM_ARRAY_JOB_ID)
        env.update({"SLURM_JOB_ID": str(job.id), "SLURM_JOB_NAME": job.name})
    env.update(stored)
    return env


def job_cwd(job) -> str:
    """Where it runs: a snapshot's command job in its copy of the working directory; a training
    job (its settings were stored at submit, relative paths and all) where it was submitted."""
    return job.snapshot_dir if job.snapshot_dir and job.kind != "train" else job.workdir


def job_argv(job, devices: list[str], resume_from: str | None = None) -> list[str]:
    """The job's command; a training that ran before (requeued) and left a checkpoint in
    `resume_from`, its run directory, goes on from it. A training the database will not record
    (db = false) and that names no directory is given one (`unrecorded_run_dirs`), so that a
    requeue finds it."""
    if job.kind == "train":  # its config was validated at submit: the stored dict is trusted
        devices_flag = device_channels(devices, _device_kind(devices))[1]
        config = json.loads(job.train_config_json)
        if resume_from:
            where = ["--out-dir", resume_from, "--resume"]
        else:
            where = ["--out-dir", unrecorded_run_dirs(job)[0]] if _unnamed_unrecorded(config) else []
        return [sys.executable, "-m", "sae_dist", "train", *stored_job_flags(config, devices_flag), *where]
    return json.loads(job.argv_json)


def _unnamed_unrecorded(config: dict) -> bool:
    return config.get("db") is False and not config.get("out_dir") and not config.get("name")


def unrecorded_run_dirs(job) -> list[str]:
    """The run directories a training the database does not record and that names none gets:
    runs/job-<id> for its first run, runs/job-<id>-<n> for its n-th requeue that had no checkpoint
    to go on from (its first directory is then taken), newest first."""
    base = state_home() / "runs" / f"job-{job.id}"
    return [str(base.with_name(f"{base.name}-{n}")) for n in range(job.requeue_count or 0, 0, -1)] + [str(base)]


def checkpointed_run_dir(engine, job) -> str | None:
    """A requeued training's run directory when its earlier run left a checkpoint there, else None.
    The trainer records each run, or sweep, with the job that ran it; a run it does not record
    (db = false) is where its settings put it, or where `job_argv` put it."""
    if job.kind != "train" or not job.requeue_count:
        return None
    from sae_dist.train.checkpoint import latest_checkpoint

    config = json.loads(job.train_config_json)
    if config.get("db") is not False:
        candidates = [_recorded_run_dir(engine, job, config)]
    elif _unnamed_unrecorded(config):
        candidates = unrecorded_run_dirs(job)
    else:  # where its settings put it, as the trainer reads them from where the job runs
        candidates = [str(Path(job.workdir, run_dir_of(config.get("name"), config.get("out_dir"))))]
    return next((d for d in candidates if d and latest_checkpoint(Path(d)) is not None), None)


def _recorded_run_dir(engine, job, config: dict) -> str | None:
    from sqlalchemy import select

    from sae_dist.db.schema import Sweep, TrainingRun

    table = Sweep if SWEEP_KEY in config else TrainingRun
    try:
        with engine.connect() as conn:
            return conn.execute(select(table.run_dir).where(table.job_id == job.id)
                                .order_by(table.id.desc()).limit(1)).scalar()
    except Exception as e:
        if storage_problem(e) is None:
            raise
        return None  # unreadable now: it starts afresh, and says so if its run directory is taken


def _device_kind(devices: list[str]) -> str:
    """Virtual devices are CPU ranks; the others GPUs."""
    return "cpu" if all(d.startswith(VIRTUAL_PREFIX) for d in devices) else "cuda"


def output_paths(job) -> tuple[Path, Path]:
    from scheduler.spec import job_output_paths

    log_dir = state_home() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return job_output_paths(job, log_dir)


def classify_exit(returncode: int, cancelled: bool, timed_out: bool,
                  stderr_tail: str) -> tuple[str, int | None, int | None]:
    """(state, exit code, signal) of an ended job, with SLURM's names."""
    sig = -returncode if returncode < 0 else None
    code = returncode if returncode >= 0 else None
    if timed_out:
        return "TIMEOUT", code, sig
    if cancelled:
        return "CANCELLED", code, sig
    if returncode == 0:
        return "COMPLETED", 0, None
    if "out of memory" in stderr_tail.lower():
        return "OUT_OF_MEMORY", code, sig
    return "FAILED", code, sig


FAILURE_REASON_CHARS = 200


def end_reason(state: str, stderr_tail: str, stopped_by: int | None) -> str | None:
    """Why a job ended, in one line for the listings (SLURM's Reason): a failed job's last line
    of error output ("error: run directory ... already exists"), which was only in its log; a
    stop nobody asked for through the scheduler (a signal to the supervisor, `stopped_by`) named
    as that. A cancel the user asked for is named so when the end is stored (store.finish_job
    reads the request in the job's row, which the supervisor's own read may have missed)."""
    if state == "TIMEOUT":
        return "Time limit reached"
    if state == "CANCELLED":
        name = signal.Signals(stopped_by).name if stopped_by else "a signal"
        return f"Stopped by {name} to its supervisor, not by a cancel"
    if state in ("FAILED", "OUT_OF_MEMORY"):
        lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
        if lines:
            last = lines[-1]
            return last if len(last) <= FAILURE_REASON_CHARS else last[: FAILURE_REASON_CHARS - 1] + "…"
    return None


def took_effect(stop_asked: bool, ended_first: bool) -> bool:
    """Whether a cancel (or a time limit) decides how a job ended, as in SLURM: only when its
    signal reached a job that still ran; a job that had already exited keeps its own outcome
    (exit 0: COMPLETED), whatever it does with the signal once it has it (exit 0: CANCELLED)."""
    return stop_asked and not ended_first


def supervise(job_id: int) -> int:
    engine = get_engine()
    job = get_job(engine, job_id)
    if job.state != "RUNNING":
        return 0
    # We register ourselves before the job starts, and only while no one else has it: a daemon
    # that finds a RUNNING job without a supervisor puts it back in the queue (it never ran).
    me = os.getpid()
    if not claim_supervision(engine, job_id, job.started_at, me, procs.start_ticks(me)):
        return 0
    watch = DatabaseWatch.of(engine)  # the queue this job is in; a reset of the state home ends it
    devices = json.loads(job.devices_json or "[]")
    # A cancel (SIGTERM/SIGINT): end the job, then record it. The handlers only note it: one
    # that took a lock (threading.Event.set does) could interrupt the thread holding that lock
    # and wait for it forever.
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stop.append(signum))
    tracked = _track(job_id)
    try:
        out_path, err_path = output_paths(job)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        err_path.parent.mkdir(parents=True, exist_ok=True)
        stdout = open(out_path, "ab")
        stderr = stdout if err_path == out_path else open(err_path, "ab")
        proc = _start(tracked, dict(args=job_argv(job, devices, checkpointed_run_dir(engine, job)), cwd=job_cwd(job),
                                    env=job_environment(job, devices, dict(os.environ), array_tasks(engine, job)),
                                    stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True))
    except (OSError, ValueError) as e:  # program not found, workdir gone, bad pattern...
        _end_processes(tracked)
        record_until_stored(engine, job_id, FinalState("FAILED", 127, None, f"could not start: {e}", _now(),
                                                      started_at=job.started_at.isoformat()), lost=watch.lost)
        return 1
    tracked.pgid = proc.pid
    process = dict(pid=proc.pid, pgid=proc.pid, proc_start_ticks=procs.start_ticks(proc.pid),
                   stdout_path=str(out_path), stderr_path=str(err_path))
    # The job runs now, whatever the database says: while it refuses writes (locked, full...),
    # the job's process is recorded at a later poll.
    link = _JobLink(engine, job_id, process, watch)
    link.record()

    cancelled, timed_out, preempted_by = _wait_or_end(job, proc, link, tracked, stop)
    # Whatever the job left behind (detached, or re-parented to us) goes too, before its devices
    # are freed: the job has ended once its last process has.
    _end_processes(tracked)
    tail = _tail(err_path)
    state, code, sig = classify_exit(proc.returncode, cancelled, timed_out, tail)
    reason = end_reason(state, tail, stop[0] if stop else None)
    if preempted_by is not None:  # requeued by finish_job; the run itself ends PREEMPTED, as SLURM's
        state, reason = PREEMPTED, f"Preempted by job {preempted_by}"
    # Kept on disk first, then recorded, retried while the database refuses: never lost.
    if record_until_stored(engine, job_id, FinalState(state, code, sig, reason, _now(), cancelled=cancelled,
                                                   started_at=job.started_at.isoformat()), lost=watch.lost) is None:
        return 1  # no queue is left to tell, nor snapshots to release
    _poke_daemon()
    if job.snapshot_dir:
        # Its copy goes, unless another job still needs it or it wrote there. It waits for another
        # supervisor's release (two jobs ending together), which may have seen this job still running.
        release_snapshots(engine, wait_s=RELEASE_WAIT_S)
    return 0


def _wait_or_end(job, proc: subprocess.Popen, link: "_JobLink", tracked: JobProcesses,
                 stop: list[int]) -> tuple[bool, bool, int | None]:
    """Poll until the job ends, or end it: on a cancel (asked in the database, or a signal to us),
    a preemption or its time limit. Returns (cancelled, timed out, the job a preemption made room
    for, or None): each only where it took effect."""
    deadline = job.started_at.timestamp() + job.time_limit_s if job.time_limit_s else None
    cancelled = timed_out = False
    preempted_by = None
    while proc.poll() is None:
        if not stop:
            time.sleep(POLL_S)  # a signal is seen at the latest when this ends
        # A cancel signals us only once its request is committed, so a read after the signal sees
        # the request. A signal that lands during the read is taken at the next turn (no sleep
        # then), with a read after it: never as "not by a cancel" for want of that read.
        signalled = bool(stop)
        by_user, preempter = link.poll()
        if bool(stop) != signalled:
            continue
        cancel = signalled or by_user
        preempt = not cancel and preempter is not None
        late = not (cancel or preempt) and deadline is not None and time.time() >= deadline
        if cancel or preempt or late:
            ended_first = proc.poll() is not None  # it ended on its own as the cancel came
            if not ended_first:  # all of the job, its cgroup (or all we can find): SIGTERM, grace, SIGKILL
                # A preempted job gets its grace time to checkpoint (SLURM's GraceTime).
                tracked.end(grace_time(job.preempt_grace_s) if preempt else KILL_GRACE_S)
                proc.wait()
            cancelled, timed_out = took_effect(cancel, ended_first), took_effect(late, ended_first)
            preempted_by = preempter if took_effect(preempt, ended_first) else None
            break
    return cancelled, timed_out, preempted_by


@dataclass
class _JobLink:
    """What the supervisor asks of the database at each poll while its job runs: record the job's
    process until that is stored, and read a cancel or a preemption. Once the database is lost
    (`DatabaseWatch`), nothing more: a new database's job of this id is another job, whose cancel
    is not ours to take, nor its row ours to write."""

    engine: object
    job_id: int
    process: dict
    watch: DatabaseWatch
    recorded: bool = False
    orphaned: bool = False

    def record(self) -> None:
        if not self.recorded and not self.orphaned:
            self.recorded = _record_process(self.engine, self.job_id, self.process)

    def poll(self) -> tuple[bool, int | None]:
        """(a cancel was asked, the job a preemption of it makes room for, or None)."""
        if not self.orphaned and self.watch.lost():
            self.orphaned = True
            log.error("job %d: its state database %s was removed or replaced; the job runs on to its end, "
                      "which cannot be recorded", self.job_id, self.watch.path)
        if self.orphaned:
            return False, None
        self.record()
        return _stop_requests(self.engine, self.job_id)


def _track(job_id: int) -> JobProcesses:
    """How the job's processes are held together: its cgroup where cgroup v2 is writable, else
    us as its child subreaper (said in our log line, either way)."""
    path, why = cgroups.create(job_id)
    _tracked_by(job_id, path, why)
    return JobProcesses(job_id, path, root=os.getpid())


def _tracked_by(job_id: int, path, why: str | None) -> None:
    if path is None:
        _become_subreaper()
    log.info("job %d: %s", job_id, proctrack.describe(str(path) if path else None, why))


def _start(tracked: JobProcesses, popen: dict) -> subprocess.Popen:
    """Start the job's first process; with a cgroup, it enters the cgroup (in a preexec_fn,
    after the fork and before the exec), so it and all it starts are in it from the outset.
    A child that cannot enter it runs nothing: the job then starts in the fallback."""
    if tracked.cgroup is None:
        return subprocess.Popen(**popen)
    try:
        fd = cgroups.entry(tracked.cgroup)
    except OSError as e:
        why = f"cannot enter {tracked.cgroup}: {e.strerror or e}"
    else:
        try:
            return subprocess.Popen(**popen, preexec_fn=lambda: os.write(fd, b"0"))
        except subprocess.SubprocessError as e:  # the preexec_fn failed: the child ran nothing of the job
            why = f"cannot enter {tracked.cgroup}: {e}"
        finally:
            os.close(fd)
    cgroups.remove(tracked.cgroup)
    tracked.cgroup = None
    _tracked_by(tracked.job_id, None, why)
    return subprocess.Popen(**popen)


def _end_processes(tracked: JobProcesses) -> None:
    """SIGKILL every process of the job still alive, wait until all are gone, remove its cgroup."""
    tracked.end(None)
    if not tracked.remove():
        log.warning("job %d: could not remove its cgroup %s", tracked.job_id, tracked.cgroup)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _record_process(engine, job_id: int, process: dict) -> bool:
    """Record the job's process (pid, its start time, output paths); False while the database
    refuses the write (asked again next poll), True once stored."""
    try:
        record_process(engine, job_id, **process)
        return True
    except Exception as e:
        if storage_problem(e) is None:
            raise
        engine.dispose()
        return False


def _stop_requests(engine, job_id: int) -> tuple[bool, int | None]:
    """(a cancel was asked, the job a preemption of it makes room for, or None)."""
    from sqlalchemy import select

    from scheduler.store import JOBS

    try:
        with engine.connect() as conn:
            row = conn.execute(select(JOBS.c.cancel_requested, JOBS.c.preempted_by).where(JOBS.c.id == job_id)).first()
            return (bool(row.cancel_requested), row.preempted_by) if row else (False, None)
    except Exception as e:
        if storage_problem(e) is None:
            raise
        engine.dispose()  # unreadable for now: the job runs on; asked again next poll
        return False, None


def _tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _become_subreaper() -> None:
    """Orphans of the job are re-parented to us (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)
        except OSError:
            pass


def _poke_daemon() -> None:
    from scheduler.control import wake_daemon

    wake_daemon()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(message)s")
    return supervise(int(args[0]))


if __name__ == "__main__":
    sys.exit(main())

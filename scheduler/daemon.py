"""The scheduler daemon: one per state directory; schedules, reaps and samples every device.

Each pass (on every wake-up, at least once a second) runs under `scheduler.lock`: it frees the
devices of jobs whose supervisor vanished (NODE_FAIL, or requeued; back to PENDING when none
ever registered), reads the devices (a device with an open fault is unavailable; its health is
re-checked now and then, see `scheduler.health`) and samples them. Only when something changed
(`plan_due`) does it read the jobs changed since its last plan (`job_changes`, written by
database triggers) into the queue it keeps, ask the pure policy which pending jobs start on
which devices, apply that in one transaction and start a supervisor per started job: an idle
pass reads nothing of the queue, however long. Running jobs do not depend on the daemon: kill it
and their supervisors carry on; a new daemon adopts them (it only has to check they are alive).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import select
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

from filelock import FileLock
from sqlalchemy import delete, insert

from sae_dist.db import FINAL_JOB_STATES, GpuSample, get_engine, immediate_transaction, utcnow
from sae_dist.db.schema import Device
from sae_dist.paths import state_home
from scheduler import cgroups, control, procs, proctrack, store
from scheduler.busy import classify
from scheduler.devices import CpuSampler, DeviceInfo, inventory
from scheduler.faults import Fault, apply_faults, device_faults, recheck_interval_s
from scheduler.final_state import replay_final_state
from scheduler.health import HealthChecker, record_lost
from scheduler.policy import DeviceView, JobView, plan
from scheduler.sharing import shared_use, sharers
from scheduler.snapshot import release_snapshots
from scheduler.spec import grace_time
from scheduler.storage_errors import storage_problem
from scheduler.tracking import JobProcesses

log = logging.getLogger(__name__)

PASS_INTERVAL_S = 1.0
MAX_STORAGE_BACKOFF_S = 8.0  # passes while the state database refuses: 1, 2, 4, 8, 8... s apart
SAMPLE_FLUSH_S = 5.0  # samples are written in batches
RETENTION_DAYS = float(os.environ.get("SAE_DIST_SAMPLE_RETENTION_DAYS", "7"))
# Without a change seen, the queue is planned again this often anyway: a device's free memory
# (for --mem-per-gpu) and the backfill window move with time, not with any write we could see.
FULL_PASS_S = 10.0
RELOAD_S = 300.0  # the queue is read whole this often anyway (a change row is cheap insurance, not proof)
FORGET_EVERY = 1000  # delete the change rows read, in batches
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL for the processes of a job whose supervisor vanished
MAX_LAUNCH_FAILURES = 3  # supervisors of one job that died before registering, in a row, before it fails


@dataclass(frozen=True)
class Seen:
    """What one pass saw of the things that can let a pending job start."""

    queue_version: int  # the newest row of job_changes (submits, ends, cancels, holds, releases...)
    reaped: bool  # a running job's supervisor was gone
    devices: tuple  # (uuid, free, unavailable) of each device
    poked: bool  # someone woke us (submit, an action, a supervisor that finished)
    now: float


def plan_due(last: Seen | None, seen: Seen, next_begin: float, full_pass_s: float) -> bool:
    """Whether this pass must plan: something changed since the last plan, a pending job's begin
    time came, or the last plan is `full_pass_s` old. An idle pass plans nothing, so its cost does
    not grow with the number of pending jobs."""
    if last is None or seen.poked or seen.reaped:
        return True
    return (seen.queue_version != last.queue_version or seen.devices != last.devices
            or seen.now >= next_begin or seen.now - last.now >= full_pass_s)


class Daemon:
    def __init__(self, engine=None):
        self.health = HealthChecker(recheck_interval_s())  # a bad value stops us before anything starts
        self.engine = engine or get_engine()
        self.storage_backoff_s = 0.0  # > 0 while the state database refuses writes
        # Signal handlers only set these flags: a handler that took a lock (Event.set) could run
        # while the main thread holds that very lock, and hang the daemon for good.
        self.stopping = False
        self.poked = False
        self.sampler = CpuSampler()
        self.samples: list[dict] = []
        self.last_flush = time.monotonic()
        self.last_retention = 0.0
        self.pass_lock = FileLock(str(state_home() / "scheduler.lock"))
        self.last_seen: Seen | None = None  # as of the last plan
        self.next_begin = math.inf  # the earliest begin time among pending jobs, as of the last plan
        self.queue: dict[int, tuple[JobView, str | None]] = {}  # pending, not held: view, stored reason
        self.seq: int | None = None  # the last job change read into `queue`
        self.last_version = 0  # the queue version the last plan accounts for
        self.loaded_at = 0.0  # when `queue` was last read whole
        self.forgotten = 0  # job changes up to this one are deleted
        self.spawned: dict[int, int] = {}  # job id -> the supervisor we forked, until it runs
        self.exited: set[int] = set()  # those of them we have collected
        self.launch_failures: dict[int, int] = {}  # job id -> its forks that died before registering, in a row
        self.orphaned: dict[int, float] = {}  # job id -> when we first found its supervisor gone
        self.swept = False  # the stale cgroups and processes of jobs that ended while no daemon ran
        self.inventory: list[dict] | None = None  # the device rows last written
        self.home_lost = False  # the state home was removed under us: we stopped, and exit 1
        self.expected: tuple | None | str = "unwritten"  # the head's (job id, expected start) last written

    # ---- the loop ----
    def run(self) -> None:
        # Handlers first: the moment the pid file names us, anyone may send us SIGUSR1 (a
        # supervisor that finished wakes the daemon), and its default action would kill us.
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "poked", True))
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        lock = control.take_daemon_lock()
        held = control.lock_file_identity()
        wake_r, wake_w = os.pipe()
        try:
            os.set_blocking(wake_r, False)
            os.set_blocking(wake_w, False)
            signal.set_wakeup_fd(wake_w)  # any signal wakes the select below, even one just before it
            me = control.write_pid_file()
            log.info("daemon %d started for %s", me, state_home())
            left = cgroups.leave_job_cgroup()
            if left:
                log.info("started from inside a job: moved out of its cgroup %s", left)
            while not self.stopping:
                if control.lock_file_identity() != held:
                    # Its queue is gone with it: scheduling on would start jobs nobody can see
                    # from a database already deleted, beside the next daemon's.
                    log.error("the state home %s was removed or replaced while this daemon ran; stopping "
                              "(jobs already running go on under their supervisors)", state_home())
                    self.home_lost = True
                    return
                started = time.monotonic()
                self._reap_children()
                try:
                    self.scheduling_pass()
                    self._storage_recovered()
                except Exception as e:  # one bad pass must not stop the queue
                    self._pass_failed(e)
                if not (self.poked or self.stopping):
                    wait = max(self.storage_backoff_s, PASS_INTERVAL_S) - (time.monotonic() - started)
                    select.select([wake_r], [], [], max(0.0, wait))
                _drain(wake_r)
            self._flush_samples(force=True)
        finally:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
            self.health.stop()
            lock.release()

    def _pass_failed(self, error: Exception) -> None:
        """A pass that failed: a bug is logged with its traceback; a state database that refuses
        (read-only, full, locked) is one line per outage, every pooled connection dropped (SQLite
        keeps the -wal/-shm handles it opened while they were read-only) and passes spaced out,
        up to MAX_STORAGE_BACKOFF_S, until one succeeds again."""
        problem = storage_problem(error)
        if problem is None:
            log.exception("scheduling pass failed")
            return
        if not self.storage_backoff_s:
            log.warning("the state database in %s: %s; retrying, less often while it lasts", state_home(), problem)
        self.storage_backoff_s = min(MAX_STORAGE_BACKOFF_S, max(PASS_INTERVAL_S, 2 * self.storage_backoff_s))
        self.engine.dispose()

    def _storage_recovered(self) -> None:
        if self.storage_backoff_s:
            log.warning("the state database in %s takes writes again", state_home())
            self.storage_backoff_s = 0.0

    # ---- one pass ----
    def scheduling_pass(self) -> list[int]:
        """Reap, read the devices, sample them; plan only when something changed (see `plan_due`)."""
        with self.pass_lock:
            now = time.time()
            with self.engine.connect() as conn:
                version = store.last_change(conn)
                running = store.running_jobs(conn)
                allocations = store.active_allocations(conn)
            # Samples name the job that runs on a device; an exclusive job's other devices are
            # held but idle, and must not dilute its utilisation (acct, benchmarks).
            # A device several shared jobs hold names none of them: its readings are theirs together.
            shared_devices = {u for j in running if j.shared for u in json.loads(j.devices_json or "[]")}
            in_use = {u: j.id for j in running for u in json.loads(j.devices_json or "[]")
                      if allocations.get(u) == j.id and u not in shared_devices}
            if not self.swept:
                self._sweep_stale(running)
            alive = self._reap(running, now)
            if len(alive) != len(running):  # it freed devices
                with self.engine.connect() as conn:
                    allocations = store.active_allocations(conn)
            pids = _with_cgroup_members(procs.jobs_pids(alive), alive)  # one /proc scan a pass, whatever runs
            devices = self._read_devices(alive, allocations, self._faults(now), pids)
            started_at = {j.id: j.started_at.timestamp() for j in alive if j.started_at}
            our_pids = {p for job_pids in pids.values() for p in job_pids}
            states = classify(devices, {u: j for u, j in allocations.items()}, started_at, our_pids, now)
            self._sample(devices, in_use)
            views = [DeviceView(uuid=d.uuid, index=d.index, free=states[d.uuid].state == "idle",
                                free_memory=d.memory_free, unavailable=states[d.uuid].state == "unavailable",
                                memory_total=d.memory_total)
                     for d in devices]
            seen = Seen(version, len(alive) != len(running), tuple((v.uuid, v.free, v.unavailable) for v in views),
                        self.poked, now)
            if not plan_due(self.last_seen, seen, self.next_begin, FULL_PASS_S):
                return []
            self.poked = False  # a wake-up from now on asks for another pass
            self.last_version = version
            started = self._plan_and_start(alive, allocations, views, now)
            self.last_seen = replace(seen, queue_version=self.last_version)
        return started

    def _plan_and_start(self, running: list, allocations: dict[str, int], views: list[DeviceView],
                        now: float) -> list[int]:
        """Plan over the schedulable pending jobs, start what it says, write changed reasons."""
        with self.engine.connect() as conn:
            self._follow_queue(conn, now)
            pending = [view for view, _ in self.queue.values()]
            deps = {d for j in pending for _, d in j.dependencies}
            dep_states = store.dependency_states(conn, deps)
        finished = {i: s for i, s in dep_states.items() if s in FINAL_JOB_STATES}
        live = {i for i, s in dep_states.items() if s not in FINAL_JOB_STATES}
        held: dict[int, list[str]] = {}
        for uuid, job_id in allocations.items():
            held.setdefault(job_id, []).append(uuid)
        running_views = [_job_view(j, held.get(j.id, ())) for j in running]
        use = shared_use(running_views)
        views = [replace(v, shared_used=use.get(v.uuid)) for v in views]
        decision = plan(pending, running_views, views,
                        {**finished, **{d: "UNKNOWN" for d in deps - set(dep_states)}}, now, live_ids=live)
        changed = {i: r for i, r in decision.reasons.items() if self.queue[i][1] != r}
        if decision.preempt:  # their supervisors see the mark within a poll and stop them (grace, requeue)
            for job_id in store.request_preemptions(self.engine, decision.preempt):
                log.info("preempting job %d for job %d", job_id, decision.preempt[job_id])
        started = store.start_jobs(self.engine, decision.starts, changed, holds=decision.holds)
        self._note_reservation(decision.reservation)
        self.queue.update((i, (self.queue[i][0], r)) for i, r in changed.items())
        for job_id, _, _ in started:
            self.queue.pop(job_id, None)
            self._spawn_supervisor(job_id)
        if started:
            self._skip_own_changes({job_id for job_id, _, _ in started})
        waits = [j.begin_at for j in pending if j.begin_at is not None and j.begin_at > now]
        self.next_begin = min(waits, default=math.inf)
        return [job_id for job_id, _, _ in started]

    def _note_reservation(self, reservation) -> None:
        """The head job's expected start, for `queue --start`, written when it changed: the
        reservation's time, or None where no running job's time limit says when."""
        want = None if reservation is None else (
            reservation.job_id, None if math.isinf(reservation.start_at) else round(reservation.start_at))
        if want == self.expected:
            return
        job_id, when = want or (None, None)
        store.set_expected_start(self.engine, job_id,
                                 datetime.fromtimestamp(when, timezone.utc) if when is not None else None)
        self.expected = want

    def _skip_own_changes(self, started: set[int]) -> None:
        """The change rows of the jobs we just started are ours: no need to plan again for them.
        Only while they are all still RUNNING and nothing else changed (else the next pass reads it)."""
        with self.engine.connect() as conn:
            seq, ids = store.changed_jobs(conn, self.seq)
            if not ids <= started or any(s != "RUNNING" for s in store.job_states(conn, ids).values()):
                return
        self.seq = seq
        self.last_version = seq

    def _follow_queue(self, conn, now: float) -> None:
        """Bring `self.queue` (pending jobs not held: view, stored reason) up to date by reading
        only the jobs changed since the last pass; all of them at start and every RELOAD_S."""
        if self.seq is None or now - self.loaded_at >= RELOAD_S:
            seq = store.last_change(conn)  # before the rows: a change made meanwhile is read again
            rows, self.queue, self.loaded_at = store.queue_rows(conn), {}, now
            full = True
        else:
            full = False
            seq, ids = store.changed_jobs(conn, self.seq)
            rows = store.queue_rows(conn, ids) if ids else []
            for job_id in ids:
                self.queue.pop(job_id, None)
        # A queued job's request never changes (a hold takes it out of the queue; a changed one
        # is read again), so its view is built once, not on every pass.
        self.queue.update((r.id, (_job_view(r), r.reason)) for r in rows if r.state == "PENDING" and not r.held)
        self.seq = seq
        if full:  # the views live long: spare the cycle collector walking them every pass
            release_snapshots(self.engine)  # those of jobs that ended with no supervisor to see to it
            gc.collect()
            gc.freeze()
        if seq - self.forgotten >= FORGET_EVERY:
            store.forget_changes(self.engine, seq)
            self.forgotten = seq

    def _reap(self, running: list, now: float) -> list:
        """Jobs whose supervisor is gone: end what is left of them, free their devices. A job
        no supervisor registered for never ran: back to the queue, unless our own fork of its
        supervisor is still on its way."""
        alive = []
        for job in running:
            if procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks):
                alive.append(job)
                self.launch_failures.pop(job.id, None)
                continue
            child = self.spawned.get(job.id)
            if job.supervisor_pid is None and child is not None and child not in self.exited:
                alive.append(job)  # forked by us a moment ago, registering itself now
                continue
            if job.supervisor_pid is None:
                if not self._unstart(job.id, child is not None):
                    alive.append(job)  # its supervisor registered in the meantime
                continue
            if not self._job_processes_ended(job, now):
                alive.append(job)  # its devices stay held until its last process is gone
                continue
            # The end its supervisor kept on disk (it saw the job end while the database refused
            # writes) is the truth; NODE_FAIL only when it kept none.
            state = replay_final_state(self.engine, job.id) or store.finish_job(
                self.engine, job.id, "NODE_FAIL", reason="its supervisor vanished (killed, or the machine restarted)")
            log.warning("job %d: supervisor gone, %s", job.id, state)
        running_ids = {j.id for j in alive}
        self.spawned = {j: p for j, p in self.spawned.items() if j in running_ids}
        self.orphaned = {j: t for j, t in self.orphaned.items() if j in running_ids}
        return alive

    def _sweep_stale(self, running: list) -> None:
        """Once, at our first pass: the cgroups of jobs that do not run (they ended while no
        daemon ran and their supervisor could not remove it) and the processes carrying the mark
        of such a job are killed, and the cgroups removed."""
        ids = {j.id for j in running}
        stale = {i: cgroups.job_path(i) for i in proctrack.stale_jobs(cgroups.job_cgroups(), ids)}
        marked = proctrack.stale_marks(procs.marked(cgroups.home_key()), ids)
        for path in stale.values():
            cgroups.kill(path)
        for pids in marked.values():
            procs.signal_pids(pids, signal.SIGKILL)
        for job_id, path in stale.items():
            if not (cgroups.wait_empty(path, 5.0) and cgroups.remove(path)):
                log.warning("job %d ended, but its cgroup %s could not be emptied and removed", job_id, path)
        if stale or marked:
            log.warning("killed what was left of ended jobs: cgroups of jobs %s, processes of jobs %s",
                        sorted(stale), sorted(marked))
        self.swept = True

    def _unstart(self, job_id: int, forked_here: bool) -> bool:
        """A RUNNING job whose supervisor never registered never ran: back to PENDING, its devices
        freed, whether its daemon died before the fork or our fork died before registering (the
        database refused its write, say). After MAX_LAUNCH_FAILURES forks died in a row it is
        NODE_FAIL with the reason, rather than a loop of launches. False when a supervisor
        registered meanwhile."""
        if forked_here:
            failures = self.launch_failures[job_id] = self.launch_failures.get(job_id, 0) + 1
            if failures >= MAX_LAUNCH_FAILURES:
                state = store.finish_job(
                    self.engine, job_id, "NODE_FAIL", reason=f"its supervisor died before starting it, {failures} "
                    f"times in a row (see {state_home() / 'logs' / 'supervisors.log'})")
                self.launch_failures.pop(job_id, None)
                log.warning("job %d: %s after %d launches that failed", job_id, state, failures)
                return True
        state = store.unstart_job(self.engine, job_id)
        if state is None:
            return False
        why = ("its supervisor died before registering" if forked_here
               else "its daemon died before its supervisor started")
        log.warning("job %d: %s; %s", job_id, why, state)
        return True

    def _job_processes_ended(self, job, now: float) -> bool:
        """End the processes of a job whose supervisor vanished, a step a pass: its whole cgroup
        and all the fallback finds (its tree, process group and mark), SIGTERM first, SIGKILL
        once KILL_GRACE_S has passed; True once none is left and its cgroup is removed. Never
        waits here: a job that ignores SIGTERM held every other job's scheduling for the whole grace."""
        path = cgroups.job_path(job.id)
        held = JobProcesses(job.id, path if path is not None and path.is_dir() else None, root=job.pid,
                            root_ticks=job.proc_start_ticks, root_is_job=True, pgid=job.pgid, thorough=True)
        first = self.orphaned.get(job.id)
        if proctrack.orphan_ended(held.populated(), held.left(), first, now):
            return held.remove()  # False: a process entered it meanwhile (the next pass ends it)
        self.orphaned.setdefault(job.id, now)
        sig = proctrack.kill_signal(first, now, KILL_GRACE_S)
        if sig is not None:
            held.signal(sig)
        return False

    def _spawn_supervisor(self, job_id: int) -> None:
        """Fork the job's supervisor: it inherits our imports, so a job starts in milliseconds
        rather than the ~0.4 s a fresh Python takes to import the database layer. It registers
        itself (`store.claim_supervision`) before it starts the job."""
        log_path = state_home() / "logs" / "supervisors.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # No SQLite connection may cross the fork: the child would inherit SQLite's per-process
        # lock bookkeeping for the file (believing it holds locks only this daemon holds), which
        # breaks once this daemon dies. Closing the pool here costs one reconnect (~1 ms).
        self.engine.dispose()
        pid = os.fork()
        if pid == 0:  # the supervisor: a session of its own, so it outlives this daemon
            code = 1
            try:
                os.setsid()
                _name_supervisor(job_id)
                _close_lock_files()
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                signal.set_wakeup_fd(-1)  # the daemon's wake-up pipe is not ours
                for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                from scheduler.supervisor import supervise

                code = supervise(job_id)
            except BaseException:
                log.exception("supervisor of job %d failed", job_id)
            finally:
                logging.shutdown()
                os._exit(code)
        self.spawned[job_id] = pid
        self.exited.discard(pid)

    def _reap_children(self) -> None:
        """Collect ended supervisors (our children) so none lingers as a zombie."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited.add(pid)
        self.exited &= set(self.spawned.values())

    # ---- devices ----
    def _faults(self, now: float) -> dict[str, Fault]:
        """The open faults, after settling the health checks that ended and starting those due."""
        self.health.collect(self.engine)
        faults = device_faults(self.engine)
        self.health.start_due(faults, now)
        return faults

    def _read_devices(self, running: list, allocations: dict[str, int], faults: dict[str, Fault],
                      pids: dict[int, list[int]]) -> list[DeviceInfo]:
        read = inventory(procs.pids_by_device(running, pids), self.sampler)
        faults = record_lost(self.engine, read, faults, allocations)  # a GPU NVML says is lost fails
        devices = apply_faults(read, faults)
        views = [_job_view(j) for j in running if j.shared]
        self._store_inventory(devices, {d.uuid: sharers(d.uuid, d.processes, views, pids) for d in devices})
        return devices

    def _store_inventory(self, devices: list[DeviceInfo], shared: dict[str, list[dict]] | None = None) -> None:
        now = utcnow()
        shared = shared or {}
        rows = [{"uuid": d.uuid, "index": d.index, "name": d.name, "virtual": d.virtual, "available": d.available,
                 "error": d.error, "memory_total": d.memory_total, "pci_bus_id": d.pci_bus_id, "updated_at": now,
                 "sharers_json": json.dumps(shared[d.uuid]) if shared.get(d.uuid) else None}
                for d in devices]
        table = Device.__table__
        same = [{k: v for k, v in r.items() if k != "updated_at"} for r in rows]
        if same == self.inventory:
            return  # an idle pass writes nothing: the inventory is rewritten when it changes
        with self.engine.begin() as conn:
            conn.execute(delete(table).where(table.c.uuid.not_in([r["uuid"] for r in rows])))
            for row in rows:
                updated = conn.execute(table.update().where(table.c.uuid == row["uuid"]).values(**row))
                if updated.rowcount == 0:
                    conn.execute(insert(table).values(**row))
        self.inventory = same

    # ---- samples ----
    def _sample(self, devices: list[DeviceInfo], in_use: dict[str, int]) -> None:
        """Queue one sample of each device, with the job running on it (`in_use`: uuid -> job id)."""
        now = utcnow()
        for d in devices:
            self.samples.append({
                "device_uuid": d.uuid, "time": now, "utilization_pct": d.utilization_pct,
                "memory_used": d.memory_used, "memory_total": d.memory_total, "memory_free": d.memory_free,
                "temperature_c": d.temperature_c, "power_w": d.power_w, "job_id": in_use.get(d.uuid)})
        self._flush_samples()

    def _flush_samples(self, force: bool = False) -> None:
        if not self.samples or (not force and time.monotonic() - self.last_flush < SAMPLE_FLUSH_S):
            return
        with self.engine.begin() as conn:
            conn.execute(insert(GpuSample.__table__), self.samples)
        self.samples, self.last_flush = [], time.monotonic()
        if time.monotonic() - self.last_retention > 3600:
            self.last_retention = time.monotonic()
            thin_samples(self.engine, utcnow() - timedelta(days=RETENTION_DAYS))


def thin_samples(engine, cutoff: datetime, keep_every_s: int = 60) -> int:
    """Samples older than cutoff are thinned to one per device per keep_every_s. Returns rows removed."""
    from sqlalchemy import select

    table = GpuSample.__table__
    with immediate_transaction(engine) as conn:  # read then delete: hold the write lock from the start
        rows = conn.execute(select(table.c.id, table.c.device_uuid, table.c.time)
                            .where(table.c.time < cutoff).order_by(table.c.device_uuid, table.c.time)).all()
        keep, drop = set(), []
        for row in rows:
            t = row.time if row.time.tzinfo else row.time.replace(tzinfo=timezone.utc)
            key = (row.device_uuid, int(t.timestamp()) // keep_every_s)
            if key in keep:
                drop.append(row.id)
            else:
                keep.add(key)
        for i in range(0, len(drop), 500):
            conn.execute(delete(table).where(table.c.id.in_(drop[i:i + 500])))
    return len(drop)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _with_cgroup_members(pids: dict[int, list[int]], running: list) -> dict[int, list[int]]:
    """`procs.jobs_pids` plus every process in each job's cgroup: a process the job detached
    (setsid, double fork) counts on the job's device too, not as another user's."""
    top = cgroups.parent() if running else None
    for job in running:
        members = cgroups.procs(top / proctrack.job_name(job.id)) if top is not None else []
        if members:
            pids[job.id] = list(dict.fromkeys([*pids.get(job.id, []), *members]))
    return pids


def _name_supervisor(job_id: int) -> None:
    """A forked supervisor carries the daemon's command line, so stopping "the daemon" by name
    (`pkill -f "scheduler daemon"`) would stop every running job: it takes a name of its own."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # an install without it (the GPU check's): the daemon's line stays
        return
    setproctitle(f"sae-dist supervisor of job {job_id}")


def _close_lock_files() -> None:
    """In a forked supervisor: drop the daemon's lock files. flock locks belong to the open file,
    which fork shares, so a supervisor holding them would keep a new daemon from starting after
    this one is killed."""
    home = str(state_home().resolve())
    for fd, target in procs.own_open_files().items():
        if target.startswith(home) and target.endswith(".lock"):
            os.close(fd)


def _job_view(job, held: Iterable[str] = ()) -> JobView:
    """The policy's view of a job; a running one holds the devices it runs on plus `held` (its
    allocations: for an exclusive job, every device)."""
    runs_on = tuple(json.loads(job.devices_json)) if job.devices_json else ()
    return JobView(
        id=job.id, priority=job.priority, submitted_at=job.submitted_at.timestamp(), gpus=job.gpus,
        gpu_ids=tuple(json.loads(job.gpu_ids_json)) if job.gpu_ids_json else None,
        mem_per_gpu=job.mem_per_gpu, time_limit_s=job.time_limit_s,
        begin_at=job.begin_at.timestamp() if job.begin_at else None, held=job.held,
        dependencies=tuple((k, int(i)) for k, i in json.loads(job.dependencies_json)),
        started_at=job.started_at.timestamp() if job.started_at else None,
        devices=runs_on + tuple(sorted(u for u in set(held) if u not in runs_on)),
        exclusive=bool(job.exclusive), array_id=job.array_job_id, array_limit=job.array_max_running,
        shared=bool(job.shared), preemptible=bool(job.preemptible), grace_s=grace_time(job.preempt_grace_s),
        leaving=job.preempted_by is not None)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s daemon %(message)s")
    daemon = Daemon()
    daemon.run()
    return 1 if daemon.home_lost else 0


__all__ = ["Daemon", "Seen", "plan_due", "thin_samples", "main"]

"""Every read-modify-write on jobs and devices, each one transaction that holds the write lock.

Select-then-update is only safe inside `BEGIN IMMEDIATE` (SQLite) or as one atomic statement
(else two can take one device); the partial unique indexes on allocations and ports make a double allocation
impossible even if a bug got past that. Functions here take an engine and plain values, and
return plain values; the daemon, the supervisor, the CLI and the app share them.
"""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine

from sae_dist.db import FINAL_JOB_STATES, Allocation, Job, immediate_transaction, utcnow
from sae_dist.db.schema import PREEMPTED, JobChange
from sae_dist.errors import UserError
from scheduler.array_submit import task_rows
from scheduler.arrays import array_state
from scheduler.newjob import NewJob, check_dependencies_found, job_row  # NewJob: callers import it from here too

JOBS = Job.__table__
ALLOCATIONS = Allocation.__table__
CHANGES = JobChange.__table__

# Rendezvous ports handed to jobs: away from torchrun's default 29500.
PORT_RANGE = range(29600, 30600)
CANCELLED_BY_USER = "Cancelled by user"  # the reason a cancel through the scheduler leaves


class JobNotFound(UserError):
    pass


def submit(engine: Engine, job: NewJob, now: datetime | None = None) -> int:
    """Queue one job; its dependencies must name existing jobs. Returns the job id."""
    return submit_many(engine, [job], now)[0]


def submit_many(engine: Engine, jobs: list[NewJob], now: datetime | None = None) -> list[int]:
    """Queue several jobs in one transaction (all or none)."""
    now = now or utcnow()
    with immediate_transaction(engine) as conn:
        _check_dependencies(conn, jobs)
        return [conn.execute(insert(JOBS).values(**job_row(job, now)).returning(JOBS.c.id)).scalar_one()
                for job in jobs]


def submit_array(engine: Engine, tasks: list[tuple[int, NewJob]], now: datetime | None = None) -> int:
    """Queue an array's tasks, (task id, job), in one transaction (all or none); the array's id
    (its first task's)."""
    rows = task_rows(tasks, now or utcnow())
    with immediate_transaction(engine) as conn:
        _check_dependencies(conn, [job for _, job in tasks[:1]])
        first = conn.execute(insert(JOBS).values(**rows[0]).returning(JOBS.c.id)).scalar_one()
        conn.execute(update(JOBS).where(JOBS.c.id == first).values(array_job_id=first))
        if len(rows) > 1:
            conn.execute(insert(JOBS), [{**row, "array_job_id": first} for row in rows[1:]])
        return first


def _check_dependencies(conn: Connection, jobs: list[NewJob]) -> None:
    wanted = {dep_id for job in jobs for _, dep_id in job.dependencies}
    if wanted:
        check_dependencies_found(wanted, conn.scalars(select(JOBS.c.id).where(JOBS.c.id.in_(wanted))))


def get_job(engine_or_conn: Engine | Connection, job_id: int) -> Job:
    row = _first(engine_or_conn, select(JOBS).where(JOBS.c.id == job_id))
    if row is None:
        raise JobNotFound(f"no job {job_id} (see `queue --all`)")
    return Job.model_validate(row._mapping)


def list_jobs(engine: Engine, states: Iterable[str] | None = None, limit: int | None = None,
              newest_first: bool = False) -> list[Job]:
    """Whole `Job` rows, process ids included, for code that acts on jobs (tests, scripts); what
    people read (queue, acct, the app's tables) goes through `sae_dist.job_listing`."""
    query = select(JOBS)
    if states is not None:
        query = query.where(JOBS.c.state.in_(list(states)))
    query = query.order_by(JOBS.c.id.desc() if newest_first else JOBS.c.id)
    if limit:
        query = query.limit(limit)
    with engine.connect() as conn:
        return [Job.model_validate(r._mapping) for r in conn.execute(query)]


def finished_states(conn: Connection, ids: Iterable[int]) -> dict[int, str]:
    """Final states of the given jobs (those that ended), for dependency checks."""
    ids = list(set(ids))
    if not ids:
        return {}
    rows = conn.execute(select(JOBS.c.id, JOBS.c.state).where(
        and_(JOBS.c.id.in_(ids), JOBS.c.state.in_(list(FINAL_JOB_STATES)))))
    return {r.id: r.state for r in rows}


def active_allocations(conn: Connection) -> dict[str, int]:
    """device uuid -> job id, for every device held now."""
    rows = conn.execute(select(ALLOCATIONS.c.device_uuid, ALLOCATIONS.c.job_id)
                        .where(ALLOCATIONS.c.released_at.is_(None)))
    return {r.device_uuid: r.job_id for r in rows}


# ---- starting and ending jobs ----

def start_jobs(engine: Engine, starts: list[tuple[int, tuple[str, ...]]], reasons: dict[int, str],
               now: datetime | None = None, holds: dict[int, tuple[str, ...]] | None = None,
               ) -> list[tuple[int, tuple[str, ...], int | None]]:
    """Apply a scheduling plan: allocate devices and mark jobs RUNNING, in one transaction.

    A job runs on its devices in `starts` (its devices_json); `holds` (exclusive jobs) names every
    device it is allocated, those included, so no other job can have the rest.
    A job that is no longer PENDING (cancelled or held meanwhile) is skipped; a device that is no
    longer free makes the unique index refuse the whole transaction, so nothing half-applies.
    Returns (job id, devices, port) of the jobs started.
    """
    holds = holds or {}
    now = now or utcnow()
    started = []
    with immediate_transaction(engine) as conn:
        by_reason: dict[str, list[int]] = {}
        for job_id, reason in reasons.items():
            by_reason.setdefault(reason, []).append(job_id)
        for reason, ids in by_reason.items():  # one statement per reason: a pass may write thousands
            for i in range(0, len(ids), 500):
                conn.execute(update(JOBS).where(and_(JOBS.c.id.in_(ids[i:i + 500]), JOBS.c.state == "PENDING",
                                                     JOBS.c.reason.is_distinct_from(reason)))
                             .values(reason=reason))
        used_ports = set(conn.scalars(select(JOBS.c.port).where(
            and_(JOBS.c.state == "RUNNING", JOBS.c.port.is_not(None)))))
        for job_id, devices in starts:
            allocated = holds.get(job_id, devices)
            shared = bool(conn.execute(select(JOBS.c.shared).where(JOBS.c.id == job_id)).scalar())
            if _held_otherwise(conn, allocated, shared):
                continue  # the plan was made on an older view: a later pass decides again
            port = _free_port(used_ports) if devices else None
            claimed = conn.execute(
                update(JOBS).where(and_(JOBS.c.id == job_id, JOBS.c.state == "PENDING", JOBS.c.held.is_(False),
                                        JOBS.c.cancel_requested.is_(False)))
                .values(state="RUNNING", reason=None, started_at=now, port=port,
                        devices_json=json.dumps(list(devices)), exit_code=None, signal=None, ended_at=None))
            if claimed.rowcount != 1:
                continue
            if allocated:
                conn.execute(insert(ALLOCATIONS), [{"job_id": job_id, "device_uuid": d, "allocated_at": now,
                                                    "shared": shared} for d in allocated])
            if port is not None:
                used_ports.add(port)
            started.append((job_id, tuple(devices), port))
    return started


def _held_otherwise(conn: Connection, devices, shared: bool) -> bool:
    """Whether a device of `devices` is held in a way this job may not join: a shared job beside
    an unshared allocation, or an unshared job beside a shared one (two unshared allocations the
    unique index refuses)."""
    if not devices:
        return False
    return conn.execute(select(ALLOCATIONS.c.id).where(and_(
        ALLOCATIONS.c.device_uuid.in_(list(devices)), ALLOCATIONS.c.released_at.is_(None),
        ALLOCATIONS.c.shared.is_(not shared))).limit(1)).first() is not None


def port_search_start(home: str) -> int:
    """Where in PORT_RANGE a state directory starts looking for a free port (stable per path)."""
    return zlib.crc32(home.encode()) % len(PORT_RANGE)


def _free_port(used: set[int]) -> int:
    """A port no running job holds and nothing on this machine listens on right now. The search
    starts at a place of this state directory's own: two state directories on one machine (two
    users, two test runs) would otherwise both hand out 29600 before either job listens on it."""
    from sae_dist.paths import state_home

    start = port_search_start(str(state_home()))
    for port in [*PORT_RANGE[start:], *PORT_RANGE[:start]]:
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free rendezvous port in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")


def record_process(engine: Engine, job_id: int, **fields) -> None:
    """Store the supervisor's or the job's pid, process group, start time, output paths."""
    with engine.begin() as conn:
        conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(**fields))


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def finish_job(engine: Engine, job_id: int, state: str, exit_code: int | None = None, signal: int | None = None,
               reason: str | None = None, now: datetime | None = None) -> str:
    """End a RUNNING job and free its devices, atomically. Returns the state it was left in.

    A job that asked for requeue and did not complete goes back to PENDING (its history keeps
    the exit code); a job that is not RUNNING any more is left alone (someone ended it first); a
    CANCELLED end of a job with a cancel requested is "Cancelled by user", whatever `reason` says.
    """
    now = now or utcnow()
    with immediate_transaction(engine) as conn:
        row = conn.execute(select(JOBS.c.state, JOBS.c.requeue_on_failure, JOBS.c.cancel_requested,
                                  JOBS.c.started_at, JOBS.c.devices_json, JOBS.c.attempts_json)
                           .where(JOBS.c.id == job_id)).first()
        if row is None or row.state != "RUNNING":
            return row.state if row else "UNKNOWN"
        requeue = (state == PREEMPTED or row.requeue_on_failure and state in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY")) \
            and not row.cancel_requested
        values = {"exit_code": exit_code, "signal": signal, "ended_at": now, "port": None, "pid": None,
                  "pgid": None, "supervisor_pid": None, "preempted_by": None}
        if requeue:
            attempt = {"state": state, "reason": reason, "started_at": _iso(row.started_at), "ended_at": _iso(now),
                       "exit_code": exit_code, "signal": signal, "devices": json.loads(row.devices_json or "[]")}
            values.update(state="PENDING", reason=reason if state == PREEMPTED else f"Requeued after {state}",
                          started_at=None, requeue_count=JOBS.c.requeue_count + 1,
                          attempts_json=json.dumps([*json.loads(row.attempts_json or "[]"), attempt]))
        else:
            # A cancel asked through the scheduler is the user's, whatever the supervisor saw (a
            # bare signal, when its read of the request failed or raced the request's commit).
            user = state == "CANCELLED" and row.cancel_requested
            values.update(state=state, reason=CANCELLED_BY_USER if user else reason)
        conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
        conn.execute(update(ALLOCATIONS).where(and_(ALLOCATIONS.c.job_id == job_id,
                                                    ALLOCATIONS.c.released_at.is_(None)))
                     .values(released_at=now))
        return "PENDING" if requeue else state


# ---- user actions ----

def cancel(engine: Engine, job_id: int) -> str:
    """PENDING -> CANCELLED at once; RUNNING -> cancel requested (the supervisor ends it).

    Returns what happened: "cancelled", "requested", or the final state it already had.
    """
    now = utcnow()
    with immediate_transaction(engine) as conn:
        job = get_job(conn, job_id)
        if job.state == "PENDING":
            conn.execute(update(JOBS).where(JOBS.c.id == job_id)
                         .values(state="CANCELLED", reason=CANCELLED_BY_USER, ended_at=now))
            return "cancelled"
        if job.state == "RUNNING":
            conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(cancel_requested=True))
            return "requested"
        return job.state


def cancel_many(engine: Engine, ids: list[int]) -> dict[int, str]:
    """`cancel` for many jobs in one transaction: id -> "cancelled", "requested" or its final state."""
    now = utcnow()
    with immediate_transaction(engine) as conn:
        states = job_states(conn, ids)
        for state, values in (("PENDING", {"state": "CANCELLED", "reason": CANCELLED_BY_USER, "ended_at": now}),
                              ("RUNNING", {"cancel_requested": True})):
            chosen = [i for i, s in states.items() if s == state]
            for i in range(0, len(chosen), 500):
                conn.execute(update(JOBS).where(JOBS.c.id.in_(chosen[i:i + 500])).values(**values))
    return {i: {"PENDING": "cancelled", "RUNNING": "requested"}.get(s, s) for i, s in states.items()}


def set_held_many(engine: Engine, ids: list[int], held: bool) -> dict[int, str]:
    """Hold (or release) the pending ones of many jobs in one transaction: id -> "done" for
    those changed, else the state that kept it as it was (a held job released, and so on)."""
    with immediate_transaction(engine) as conn:
        rows = {}
        for i in range(0, len(ids), 500):
            rows.update((r.id, r) for r in conn.execute(select(JOBS.c.id, JOBS.c.state, JOBS.c.held)
                                                       .where(JOBS.c.id.in_(ids[i:i + 500]))))
        chosen = [i for i, r in rows.items() if r.state == "PENDING" and bool(r.held) != held]
        for i in range(0, len(chosen), 500):
            conn.execute(update(JOBS).where(JOBS.c.id.in_(chosen[i:i + 500]))
                         .values(held=held, reason="JobHeldUser" if held else None))
    already = "held" if held else "not held"
    return {i: "done" if i in chosen else (already if r.state == "PENDING" else r.state) for i, r in rows.items()}


def set_expected_start(engine: Engine, job_id: int | None, when: datetime | None) -> None:
    """The head job's expected start (None: not known), and no other job's: the scheduler's one
    reservation, written when it changes."""
    with immediate_transaction(engine) as conn:
        conn.execute(update(JOBS).where(JOBS.c.expected_start_at.is_not(None), JOBS.c.id != (job_id or 0))
                     .values(expected_start_at=None))
        if job_id is not None:
            conn.execute(update(JOBS).where(JOBS.c.id == job_id, JOBS.c.state == "PENDING")
                         .values(expected_start_at=when))


def update_pending(engine: Engine, ids: list[int], values: dict[str, Any]) -> dict[int, str]:
    """Set `values` (priority, time_limit_s, begin_at) on the pending ones of many jobs, in one
    transaction: id -> "done" for those changed, else the state that kept it as it was. The
    trigger on these columns tells the daemon (a job_changes row)."""
    with immediate_transaction(engine) as conn:
        states = job_states(conn, ids)
        chosen = [i for i, s in states.items() if s == "PENDING"]
        for i in range(0, len(chosen), 500):
            conn.execute(update(JOBS).where(JOBS.c.id.in_(chosen[i:i + 500]), JOBS.c.state == "PENDING")
                         .values(**values))
    return {i: "done" if s == "PENDING" else s for i, s in states.items()}


def jobs_by_id(engine: Engine, ids: list[int]) -> list[Job]:
    found = []
    with engine.connect() as conn:
        for i in range(0, len(ids), 500):
            found += [Job.model_validate(r._mapping)
                      for r in conn.execute(select(JOBS).where(JOBS.c.id.in_(ids[i:i + 500])))]
    return found


def set_held(engine: Engine, job_id: int, held: bool) -> None:
    with immediate_transaction(engine) as conn:
        job = get_job(conn, job_id)
        if job.state != "PENDING":
            verb = "hold" if held else "release"
            raise UserError(f"cannot {verb} job {job_id}: it is {job.state}, only PENDING jobs can be")
        conn.execute(update(JOBS).where(JOBS.c.id == job_id)
                     .values(held=held, reason="JobHeldUser" if held else None))


def requeue(engine: Engine, job_id: int) -> str:
    """A finished job goes back to PENDING; a running one is cancelled and requeued by its supervisor."""
    with immediate_transaction(engine) as conn:
        job = get_job(conn, job_id)
        if job.state == "PENDING":
            raise UserError(f"job {job_id} is already PENDING")
        if job.state == "RUNNING":
            conn.execute(update(JOBS).where(JOBS.c.id == job_id)
                         .values(cancel_requested=True, reason="Requeue requested"))
            return "requested"
        conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(
            state="PENDING", reason=None, started_at=None, ended_at=None, exit_code=None, signal=None,
            cancel_requested=False, requeue_count=JOBS.c.requeue_count + 1))
        return "requeued"


def request_preemptions(engine: Engine, preempt: dict[int, int]) -> list[int]:
    """Mark each running job of `preempt` (job -> the job it makes room for) as being preempted,
    once: its supervisor sees the mark, stops it and requeues it. Returns those marked now."""
    marked = []
    with immediate_transaction(engine) as conn:
        for job_id, by in sorted(preempt.items()):
            done = conn.execute(update(JOBS).where(and_(
                JOBS.c.id == job_id, JOBS.c.state == "RUNNING", JOBS.c.preempted_by.is_(None),
                JOBS.c.preemptible.is_(True))).values(preempted_by=by, reason=f"Preempted by job {by}"))
            if done.rowcount:
                marked.append(job_id)
    return marked


def live_snapshot_dirs(engine: Engine) -> list[str]:
    """The snapshot copies (submit --snapshot) that pending and running jobs name: kept on disk."""
    with engine.connect() as conn:
        return list(conn.execute(select(JOBS.c.snapshot_dir).distinct().where(
            and_(JOBS.c.snapshot_dir.is_not(None), JOBS.c.state.not_in(list(FINAL_JOB_STATES))))).scalars())


def last_change(conn: Connection) -> int:
    """The newest job change's sequence number (database triggers write one per change that may
    let a pending job start): one indexed read tells whether anything changed."""
    return conn.execute(select(func.max(CHANGES.c.seq))).scalar() or 0


def changed_jobs(conn: Connection, after: int) -> tuple[int, set[int]]:
    """(the newest sequence number, the ids of jobs changed after `after`)."""
    rows = conn.execute(select(CHANGES.c.seq, CHANGES.c.job_id).where(CHANGES.c.seq > after)).all()
    return max((r.seq for r in rows), default=after), {r.job_id for r in rows}


def forget_changes(engine: Engine, upto: int) -> None:
    """Delete the change rows the daemon has read (but the newest)."""
    with engine.begin() as conn:
        conn.execute(CHANGES.delete().where(CHANGES.c.seq < upto))  # the newest stays: it is the version


def running_jobs(conn: Connection) -> list[Job]:
    return [Job.model_validate(r._mapping) for r in conn.execute(select(JOBS).where(JOBS.c.state == "RUNNING"))]


# What the daemon reads of a queued job: its request (for the policy), whether it is still queued,
# and the reason stored now (written again only when it changes).
QUEUE_COLUMNS = [JOBS.c[c] for c in (
    "id", "state", "held", "reason", "priority", "submitted_at", "gpus", "gpu_ids_json", "mem_per_gpu",
    "time_limit_s", "begin_at", "dependencies_json", "started_at", "devices_json", "exclusive",
    "array_job_id", "array_max_running", "preemptible", "preempt_grace_s", "preempted_by", "shared")]


def queue_rows(conn: Connection, ids: Iterable[int] | None = None) -> list:
    """Rows of QUEUE_COLUMNS: every pending job not held, or the jobs `ids` whatever their state."""
    if ids is None:
        return conn.execute(select(*QUEUE_COLUMNS).where(
            and_(JOBS.c.state == "PENDING", JOBS.c.held.is_(False)))).all()
    ids, found = sorted(set(ids)), []
    for i in range(0, len(ids), 500):  # SQLite's bound-parameter limit
        found += conn.execute(select(*QUEUE_COLUMNS).where(JOBS.c.id.in_(ids[i:i + 500]))).all()
    return found


def dependency_states(conn: Connection, ids: Iterable[int]) -> dict[int, str]:
    """id -> the state a dependency on it sees, for those of `ids` that exist: a job's own, or
    for an array's id the whole array's (scheduler.arrays.array_state: live until every task
    ended). One grouped read per 500 ids, however many tasks the arrays have."""
    found = job_states(conn, ids)
    ids = sorted(found)
    tasks: dict[int, set[str]] = {}
    for i in range(0, len(ids), 500):
        for array_id, state in conn.execute(select(JOBS.c.array_job_id, JOBS.c.state).where(
                JOBS.c.array_job_id.in_(ids[i:i + 500])).group_by(JOBS.c.array_job_id, JOBS.c.state)):
            tasks.setdefault(array_id, set()).add(state)
    for array_id, states in tasks.items():
        found[array_id] = array_state(states) or "PENDING"
    return found


def array_of(engine: Engine, array_id: int) -> list:
    """The tasks of array `array_id` (its id, train config and %N), by task id; [] when it is none."""
    with engine.connect() as conn:
        return conn.execute(select(JOBS.c.id, JOBS.c.array_task_id, JOBS.c.train_config_json,
                                   JOBS.c.array_max_running)
                            .where(JOBS.c.array_job_id == array_id).order_by(JOBS.c.array_task_id)).all()


def array_tasks(engine_or_conn: Engine | Connection, job) -> tuple[int, int, int] | None:
    """For a task of a job array: its array's task count, lowest and highest task id."""
    if job.array_job_id is None:
        return None
    row = _first(engine_or_conn, select(func.count(), func.min(JOBS.c.array_task_id), func.max(JOBS.c.array_task_id))
                 .where(JOBS.c.array_job_id == job.array_job_id))
    return tuple(row) if row is not None and row[0] else None


def job_states(conn: Connection, ids: Iterable[int]) -> dict[int, str]:
    """id -> state for those of `ids` that exist."""
    ids, found = sorted(set(ids)), {}
    for i in range(0, len(ids), 500):
        found.update(conn.execute(select(JOBS.c.id, JOBS.c.state).where(JOBS.c.id.in_(ids[i:i + 500]))).all())
    return found


def claim_supervision(engine: Engine, job_id: int, started_at: datetime, pid: int, start_ticks: int | None) -> bool:
    """A supervisor registers itself, before it starts the job: True when the job is still the
    RUNNING one it was forked for and no other supervisor has it (else it must not run it)."""
    with immediate_transaction(engine) as conn:
        return conn.execute(update(JOBS).where(and_(
            JOBS.c.id == job_id, JOBS.c.state == "RUNNING", JOBS.c.started_at == started_at,
            JOBS.c.supervisor_pid.is_(None))).values(
            supervisor_pid=pid, supervisor_start_ticks=start_ticks)).rowcount == 1


def unstart_job(engine: Engine, job_id: int, now: datetime | None = None) -> str | None:
    """A RUNNING job no supervisor ever registered for (its daemon died before or at the fork)
    never ran: back to PENDING (CANCELLED if a cancel came meanwhile), its devices freed.
    None when a supervisor registered first (the claim and this are one transaction each)."""
    now = now or utcnow()
    with immediate_transaction(engine) as conn:
        row = conn.execute(select(JOBS.c.cancel_requested).where(and_(
            JOBS.c.id == job_id, JOBS.c.state == "RUNNING", JOBS.c.supervisor_pid.is_(None),
            JOBS.c.pid.is_(None)))).first()
        if row is None:
            return None
        values = {"port": None, "devices_json": None, "started_at": None}
        if row.cancel_requested:
            values.update(state="CANCELLED", reason=CANCELLED_BY_USER, ended_at=now)
        else:
            values.update(state="PENDING", reason=None)
        conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
        conn.execute(update(ALLOCATIONS).where(and_(ALLOCATIONS.c.job_id == job_id,
                                                    ALLOCATIONS.c.released_at.is_(None)))
                     .values(released_at=now))
        return values["state"]


def pending_and_running(conn: Connection) -> tuple[list[Job], list[Job]]:
    rows = conn.execute(select(JOBS).where(or_(JOBS.c.state == "PENDING", JOBS.c.state == "RUNNING"))
                        .order_by(JOBS.c.id))
    jobs = [Job.model_validate(r._mapping) for r in rows]
    return [j for j in jobs if j.state == "PENDING"], [j for j in jobs if j.state == "RUNNING"]


def count_jobs(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(JOBS)).scalar_one()


def _first(engine_or_conn, query):
    if isinstance(engine_or_conn, Connection):
        return engine_or_conn.execute(query).first()
    with engine_or_conn.connect() as conn:
        return conn.execute(query).first()

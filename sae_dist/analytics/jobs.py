"""What the Monitor and Queue pages show about scheduler jobs, read-only and without Streamlit.

The jobs table is part of the state database's schema (which `sae_dist` owns); what jobs
*do* (cancel, hold, ...) belongs to the scheduler (`scheduler.actions`), which the pages call.
Functions return plain dicts; times stay aware datetimes, missing values None.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.engine import Engine

from sae_dist.db.schema import FINAL_JOB_STATES, Device, Job, TrainingRun

JOBS = Job.__table__

REASONS = {
    "Resources": "waiting for enough free devices",
    "Priority": "jobs of higher priority go first",
    "Dependency": "waiting for the jobs it depends on",
    "DependencyNeverSatisfied": "a job it depends on ended in a way that never satisfies it",
    "JobHeldUser": "held: release it to let it start",
    "BeginTime": "its start time has not come yet",
}
"""SLURM's reason codes (the scheduler's too), in words."""

STATE_COLORS = {"PENDING": "gray", "RUNNING": "blue", "COMPLETED": "green", "FAILED": "red",
                "CANCELLED": "orange", "TIMEOUT": "orange", "NODE_FAIL": "red",
                "OUT_OF_MEMORY": "red"}

_COLUMNS = ("id", "name", "user", "kind", "state", "reason", "priority", "gpus", "held",
            "cancel_requested", "requeue_count", "time_limit_s", "devices_json", "gpu_ids_json",
            "submitted_at", "started_at", "ended_at", "exit_code", "signal", "stdout_path",
            "stderr_path", "workdir")


# Details the scheduler appends to a code for exclusive jobs ("Resources, RunningJobs:3,5").
DETAILS = {
    "RunningJobs": "it runs alone (exclusive) and waits for job{s} {ids} to end",
    "ExclusiveJob": "exclusive job {ids} holds the whole machine",
}


def explain_reason(reason: str | None) -> str:
    """A pending job's reason code, with what it means ("Resources: waiting for ...")."""
    if not reason:
        return "waiting for the next scheduling pass"
    code, _, detail = reason.partition(", ")
    name, _, ids = detail.partition(":")
    if code in REASONS and name in DETAILS and ids:
        words = DETAILS[name].format(s="s" if "," in ids else "", ids=ids.replace(",", ", "))
        return f"{reason}: {words}"
    return f"{reason}: {REASONS[reason]}" if reason in REASONS else reason


def _job(row: Any) -> dict[str, Any]:
    job = {name: row[name] for name in _COLUMNS}
    job["devices"] = _json_list(job.pop("devices_json"))
    job["gpu_ids"] = _json_list(job.pop("gpu_ids_json"))
    job["held"] = bool(job["held"])
    job["cancel_requested"] = bool(job["cancel_requested"])
    return job


def _json_list(text: str | None) -> list[str]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _select():
    return select(*[JOBS.c[name] for name in _COLUMNS])


def get_job(engine: Engine, job_id: int) -> dict[str, Any] | None:
    """One job as a dict (columns of `jobs`, with "devices" and "gpu_ids" lists), or None."""
    with engine.connect() as conn:
        row = conn.execute(_select().where(JOBS.c.id == job_id)).mappings().first()
    return _job(row) if row is not None else None


def queue(engine: Engine, finished_limit: int = 100) -> dict[str, list[dict[str, Any]]]:
    """The queue as the Queue page shows it: "pending" (highest priority first, then oldest),
    "running" (oldest start first) and the last `finished_limit` "finished" (newest first)."""
    pending_or_running = JOBS.c.state.in_(("PENDING", "RUNNING"))
    with engine.connect() as conn:
        active = [_job(r) for r in conn.execute(
            _select().where(pending_or_running).order_by(JOBS.c.id)).mappings()]
        finished = [_job(r) for r in conn.execute(
            _select().where(JOBS.c.state.in_(sorted(FINAL_JOB_STATES)))
            .order_by(JOBS.c.id.desc()).limit(finished_limit)).mappings()]
    pending = sorted((j for j in active if j["state"] == "PENDING"),
                     key=lambda j: (-j["priority"], j["submitted_at"], j["id"]))
    running = sorted((j for j in active if j["state"] == "RUNNING"),
                     key=lambda j: (j["started_at"] or j["submitted_at"], j["id"]))
    return {"pending": pending, "running": running, "finished": finished}


def monitor_jobs(engine: Engine, limit: int = 50) -> list[dict[str, Any]]:
    """The jobs worth watching, for the Monitor's choice: running ones (newest start first),
    then pending ones, then the last `limit` that ran and ended (newest first)."""
    order = case((JOBS.c.state == "RUNNING", 0), (JOBS.c.state == "PENDING", 1), else_=2)
    query = (_select()
             .where(or_(JOBS.c.state.in_(("PENDING", "RUNNING")),
                        and_(JOBS.c.state.in_(sorted(FINAL_JOB_STATES)),
                             JOBS.c.started_at.is_not(None))))
             .order_by(order, JOBS.c.id.desc()))
    with engine.connect() as conn:
        jobs = [_job(r) for r in conn.execute(query).mappings()]
    active = [j for j in jobs if j["state"] in ("PENDING", "RUNNING")]
    return active + [j for j in jobs if j["state"] not in ("PENDING", "RUNNING")][:limit]


def latest_running(jobs: list[dict[str, Any]]) -> int | None:
    """The running job that started last (the Monitor's default), or None."""
    running = [j for j in jobs if j["state"] == "RUNNING"]
    if not running:
        return None
    return max(running, key=lambda j: (j["started_at"] or j["submitted_at"], j["id"]))["id"]


def devices(engine: Engine) -> list[dict[str, Any]]:
    """The device inventory the daemon last wrote, in index order."""
    t = Device.__table__
    with engine.connect() as conn:
        rows = conn.execute(select(t).order_by(t.c.index, t.c.uuid)).mappings().all()
    return [dict(r) for r in rows]


def training_run_of(engine: Engine, job_id: int) -> int | None:
    """The (newest) training run a job's trainer recorded, or None (a plain command, or a
    training that has not reached its first log yet)."""
    t = TrainingRun.__table__
    with engine.connect() as conn:
        return conn.execute(select(func.max(t.c.id)).where(t.c.job_id == job_id)).scalar()


def runs_by_job(engine: Engine, job_ids: list[int]) -> dict[int, dict[str, Any]]:
    """For each job with a training run: its newest run's id, last step and total steps."""
    if not job_ids:
        return {}
    t = TrainingRun.__table__
    newest = (select(t.c.job_id, func.max(t.c.id).label("id"))
              .where(t.c.job_id.in_(job_ids)).group_by(t.c.job_id).subquery())
    query = select(t.c.job_id, t.c.id, t.c.last_step, t.c.total_steps, t.c.status).join(
        newest, t.c.id == newest.c.id)
    with engine.connect() as conn:
        return {r.job_id: {"run_id": r.id, "last_step": r.last_step,
                           "total_steps": r.total_steps, "status": r.status}
                for r in conn.execute(query)}


def elapsed_s(job: dict[str, Any], now: datetime) -> float | None:
    """How long the job has run (to its end, or to now); None before it started."""
    if job["started_at"] is None:
        return None
    return ((job["ended_at"] or now) - job["started_at"]).total_seconds()


def log_paths(job: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's log files as (label, path): stdout, then stderr when it is another file."""
    out = []
    if job.get("stdout_path"):
        out.append(("stdout", job["stdout_path"]))
    if job.get("stderr_path") and job["stderr_path"] != job.get("stdout_path"):
        out.append(("stderr", job["stderr_path"]))
    return out


def tail_lines(path: str | os.PathLike[str], lines: int = 100,
               max_bytes: int = 256 * 1024) -> list[str] | None:
    """The last `lines` lines of a text file, reading at most its last `max_bytes` bytes
    (a log can be gigabytes); None when it cannot be read (not written yet, or gone)."""
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return None
    text = data.decode("utf-8", errors="replace")
    cut = size > max_bytes  # the first line read is probably a piece of a longer one
    parts = text.splitlines()
    if cut and parts:
        parts = parts[1:]
    return parts[-lines:] if lines > 0 else []

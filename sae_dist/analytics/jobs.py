"""What the Monitor and Queue pages show about scheduler jobs, read-only and without Streamlit.

The jobs table is part of the state database's schema (which `sae_dist` owns); what jobs
*do* (cancel, hold, ...) belongs to the scheduler (`scheduler.actions`), which the pages call.
Functions return plain dicts; times stay aware datetimes, missing values None.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from sae_dist.array_notation import label_rows
from sae_dist.db.schema import (
    FINAL_JOB_STATES,
    REASON_DETAIL_WORDS,
    REASON_WORDS,
    Device,
    Sweep,
    TrainingRun,
)
from sae_dist.job_listing import pending_task_groups, read_job, read_jobs
from sae_dist.job_listing import query as _query

STATE_COLORS = {"PENDING": "gray", "RUNNING": "blue", "COMPLETED": "green", "FAILED": "red",
                "CANCELLED": "orange", "TIMEOUT": "orange", "NODE_FAIL": "red",
                "OUT_OF_MEMORY": "red"}


def explain_reason(reason: str | None) -> str:
    """A pending job's reason code, with what it means ("Resources: waiting for ...")."""
    if not reason:
        return "waiting for the next scheduling pass"
    code, _, detail = reason.partition(", ")
    name, _, ids = detail.partition(":")
    if code in REASON_WORDS and name in REASON_DETAIL_WORDS and ids:
        words = REASON_DETAIL_WORDS[name].format(s="s" if "," in ids else "", ids=ids.replace(",", ", "))
        return f"{reason}: {words}"
    return f"{reason}: {REASON_WORDS[reason]}" if reason in REASON_WORDS else reason


def get_job(engine: Engine, job_id: int) -> dict[str, Any] | None:
    """One job as a dict (see `JobRow`: its columns, with "devices" and "gpu_ids" lists), or None."""
    job = read_job(engine, job_id)
    return job.as_dict() if job is not None else None


def queue(engine: Engine, finished_limit: int = 100) -> dict[str, list[dict[str, Any]]]:
    """The queue as the Queue page shows it: "pending" (highest priority first, then oldest),
    "running" (oldest start first) and the last `finished_limit` "finished" (newest first)."""
    # An array's pending tasks are one row (12_[3-999%8]), as squeue shows them: one decoded row
    # for each group, however many tasks; every row gets a label.
    groups = pending_task_groups(engine)
    active = read_jobs(engine, states=("PENDING", "RUNNING"), pending_tasks=False)
    active += read_jobs(engine, job_ids=groups) if groups else []
    active = label_rows([j.as_dict() for j in active], groups, id_key="id")
    finished = label_rows([j.as_dict() for j in read_jobs(engine, states=sorted(FINAL_JOB_STATES),
                                                          order="newest", limit=finished_limit)], {}, id_key="id")
    pending = sorted((j for j in active if j["state"] == "PENDING"),
                     key=lambda j: (-j["priority"], j["submitted_at"], j["id"]))
    running = sorted((j for j in active if j["state"] == "RUNNING"),
                     key=lambda j: (j["started_at"] or j["submitted_at"], j["id"]))
    return {"pending": pending, "running": running, "finished": finished}


def array_progress(engine: Engine, finished_shown: int = 10) -> list[dict[str, Any]]:
    """Each job array with tasks still pending or running, and the last `finished_shown` that
    ended, newest first: its id, name, %N and how many tasks are in each state (one grouped
    read, however many tasks)."""
    rows = _query('SELECT "array_job_id", MIN("name"), MAX("array_max_running"), "state", COUNT(*) '
                          'FROM "jobs" WHERE "array_job_id" IS NOT NULL GROUP BY "array_job_id", "state"', {}, engine)
    arrays: dict[int, dict[str, Any]] = {}
    for array_id, name, limit, state, count in rows:
        entry = arrays.setdefault(array_id, {"array_id": array_id, "name": name, "max_running": limit,
                                             "states": {}})
        entry["states"][state] = count
    live = [a for a in arrays.values() if a["states"].keys() & {"PENDING", "RUNNING"}]
    ended = [a for a in arrays.values() if not a["states"].keys() & {"PENDING", "RUNNING"}]
    by_newest = lambda a: -a["array_id"]  # noqa: E731
    return sorted(live, key=by_newest) + sorted(ended, key=by_newest)[:finished_shown]


def monitor_jobs(engine: Engine, limit: int = 50) -> list[dict[str, Any]]:
    """The jobs worth watching, for the Monitor's choice: running ones (newest start first),
    then pending ones, then the last `limit` that ran and ended (newest first)."""
    active = read_jobs(engine, states=("PENDING", "RUNNING"), order="newest")
    ended = read_jobs(engine, states=sorted(FINAL_JOB_STATES), started_only=True, order="newest", limit=limit)
    running_first = sorted(active, key=lambda j: j.state != "RUNNING")  # stable: newest first within
    return [j.as_dict() for j in running_first + ended]


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


def sweep_of(engine: Engine, job_id: int) -> int | None:
    """The (newest) sweep a job trained, or None: a sweep's job has one run per SAE, so it links
    to the sweep (its grid and every SAE) rather than to one of its runs."""
    t = Sweep.__table__
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


def last_log_line(job: dict[str, Any]) -> str | None:
    """The last non-blank line of the job's most recently written log file (what it is doing
    now, in its own words); None when there is none yet."""
    written = []
    for _, path in log_paths(job):
        try:
            written.append((os.path.getmtime(path), path))
        except OSError:
            continue
    for _, path in sorted(written, reverse=True):
        lines = [line for line in tail_lines(path, 20, max_bytes=16 * 1024) or [] if line.strip()]
        if lines:
            return lines[-1]
    return None

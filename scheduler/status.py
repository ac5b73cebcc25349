"""What the devices and the queue look like right now: for `info`, `recommend` and the app.

Read-only. The live inventory (NVML or virtual devices) classified against the scheduler's own
allocations and processes; the daemon's latest samples (utilisation needs a measuring window,
which the daemon has and a one-off reader does not); the queue with the progress of each running
job, from the training run it records (`training_runs.job_id`) or from its time limit.

Everything comes back as plain data (dicts, lists). A figure nobody measured stays None; the
page shows it as "—". Nothing here imports Streamlit or torch.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.engine import Engine

from sae_dist.db import FINAL_JOB_STATES, GpuSample, StepMetric, TrainingRun
from sae_dist.job_listing import JobRow, read_jobs
from scheduler.busy import DeviceState, classify
from scheduler.devices import DeviceInfo, inventory
from scheduler.faults import apply_faults, device_faults
from scheduler.store import count_jobs

SAMPLE_FRESH_S = 10.0
"""A daemon sample older than this is not "now" (the daemon samples every second)."""

RUNS = TrainingRun.__table__
STEPS = StepMetric.__table__
SAMPLES = GpuSample.__table__


# ---- devices ----

def devices_now(engine: Engine, now: float | None = None
                ) -> tuple[list[DeviceInfo], dict[str, DeviceState], dict[str, int]]:
    """(devices, state by uuid, allocations uuid -> job id): the live inventory and what each
    device is doing. A device with an open fault is unavailable, the fault its reason (and in
    `DeviceInfo.fault`). Reads no process CPU over time (see `latest_samples` for utilisation)."""
    from scheduler.procs import job_pids, pids_by_device
    from scheduler.store import active_allocations, running_jobs

    with engine.connect() as conn:
        allocations = active_allocations(conn)
        running = running_jobs(conn)
    devices = apply_faults(inventory(pids_by_device(running), None), device_faults(engine))
    started = {j.id: j.started_at.timestamp() for j in running if j.started_at}
    ours = {p for j in running for p in job_pids(j)}
    states = classify(devices, allocations, started, ours, time.time() if now is None else now)
    return devices, states, allocations


def latest_samples(engine: Engine, now: float | None = None,
                   max_age_s: float = SAMPLE_FRESH_S) -> dict[str, dict[str, Any]]:
    """The newest daemon sample of each device, by uuid, when it is at most `max_age_s` old
    (no daemon, or a stopped one: {})."""
    now = time.time() if now is None else now
    newest = (select(SAMPLES.c.device_uuid, func.max(SAMPLES.c.id).label("id"))
              .group_by(SAMPLES.c.device_uuid).subquery())
    with engine.connect() as conn:
        rows = conn.execute(select(SAMPLES).join(newest, SAMPLES.c.id == newest.c.id)).mappings().all()
    return {r["device_uuid"]: dict(r) for r in rows
            if r["time"] is not None and _ts(r["time"]) > now - max_age_s}


def device_rows(devices: list[DeviceInfo], states: dict[str, DeviceState],
                samples: dict[str, dict[str, Any]],
                sharers: dict[str, list[dict]] | None = None) -> list[dict[str, Any]]:
    """One plain row per device: identity, state (with job id and reason), its fault (a dict,
    see `Fault.as_dict`, or None) and readings.

    Memory, temperature and power are the inventory's live readings; utilisation is the
    daemon's latest fresh sample when there is one (it measures over a second), else the
    inventory's own reading. `utilization_source` says which ("daemon" / "inventory").
    """
    rows = []
    for d in devices:
        state = states.get(d.uuid) or DeviceState("unavailable", None, "no state known")
        sample = samples.get(d.uuid)
        util = sample.get("utilization_pct") if sample else None
        rows.append({
            "index": d.index, "uuid": d.uuid, "name": d.name, "label": d.label, "virtual": d.virtual,
            "available": d.available, "error": d.error, "state": state.state, "job_id": state.job_id,
            "reason": state.reason, "fault": d.fault.as_dict() if d.fault else None,
            "memory_total": d.memory_total, "memory_used": d.memory_used,
            "memory_free": d.memory_free,
            "utilization_pct": util if util is not None else d.utilization_pct,
            "utilization_source": "daemon" if util is not None else "inventory",
            "temperature_c": d.temperature_c, "power_w": d.power_w, "power_limit_w": d.power_limit_w,
            "sharers": (sharers or {}).get(d.uuid),  # submit --shared: its jobs, declared and used memory
        })
    return rows


# ---- the queue ----

def queue_overview(engine: Engine, now: datetime | None = None, pending_limit: int = 5,
                   finished_limit: int = 5) -> dict[str, Any]:
    """The queue at a glance. Keys:

    - counts: {"PENDING": n, "RUNNING": n, "held": n (of the pending)};
    - pending: the first `pending_limit` pending jobs in start order (priority, then id), each
      {id, name, gpus, priority, reason, held, submitted_at};
    - running: every running job with its progress (see `progress`), oldest first;
    - finished: the last `finished_limit` jobs that ended, newest first, each {id, name, kind,
      state, exit_code, signal, reason, started_at, ended_at, elapsed_s};
    - total_jobs: every job ever recorded.
    """
    now = now or datetime.now(timezone.utc)
    active = read_jobs(engine, states=("PENDING", "RUNNING"))
    pending = sorted((j for j in active if j.state == "PENDING"), key=lambda j: (-j.priority, j.id))
    running = sorted((j for j in active if j.state == "RUNNING"),
                     key=lambda j: (j.started_at is not None, j.started_at or j.submitted_at, j.id))
    finished = read_jobs(engine, states=sorted(FINAL_JOB_STATES), order="last_ended", limit=finished_limit)
    with engine.connect() as conn:
        runs = _runs_of_jobs(conn, [j.id for j in running if j.kind == "train"])
    return {
        "counts": {"PENDING": len(pending), "RUNNING": len(running),
                   "held": sum(1 for j in pending if j.held)},
        "pending": [{"id": j.id, "name": j.name, "gpus": j.gpus, "priority": j.priority, "reason": j.reason,
                     "held": j.held, "submitted_at": j.submitted_at} for j in pending[:pending_limit]],
        "running": [_running_row(j, runs.get(j.id), now) for j in running],
        "finished": [{"id": j.id, "name": j.name, "kind": j.kind, "state": j.state, "exit_code": j.exit_code,
                      "signal": j.signal, "reason": j.reason, "started_at": j.started_at, "ended_at": j.ended_at,
                      "elapsed_s": _elapsed(j.started_at, j.ended_at)} for j in finished],
        "total_jobs": count_jobs(engine),
    }


def _runs_of_jobs(conn, job_ids: list[int]) -> dict[int, dict[str, Any]]:
    """The latest training run of each job (a requeued job may have several), with the time of
    its first and last logged steps: job id -> {id, name, status, last_step, total_steps,
    started_at, first_step, first_time, last_logged_step, last_time}."""
    if not job_ids:
        return {}
    latest = (select(RUNS.c.job_id, func.max(RUNS.c.id).label("id"))
              .where(RUNS.c.job_id.in_(job_ids)).group_by(RUNS.c.job_id).subquery())
    rows = conn.execute(select(RUNS.c.id, RUNS.c.job_id, RUNS.c.name, RUNS.c.status, RUNS.c.last_step,
                               RUNS.c.total_steps, RUNS.c.started_at)
                        .join(latest, RUNS.c.id == latest.c.id)).mappings().all()
    out = {r["job_id"]: {**dict(r), "first_step": None, "first_time": None,
                         "last_logged_step": None, "last_time": None} for r in rows}
    by_run = {r["id"]: out[r["job_id"]] for r in rows}
    if not by_run:
        return out
    ends = conn.execute(select(STEPS.c.run_id, func.min(STEPS.c.step), func.max(STEPS.c.step))
                        .where(STEPS.c.run_id.in_(list(by_run))).group_by(STEPS.c.run_id)).all()
    for run_id, first, last in ends:
        times = dict(conn.execute(select(STEPS.c.step, STEPS.c.time).where(
            and_(STEPS.c.run_id == run_id, STEPS.c.step.in_([first, last])))).all())
        by_run[run_id].update(first_step=first, first_time=times.get(first),
                              last_logged_step=last, last_time=times.get(last))
    return out


def _running_row(job: JobRow, run: dict[str, Any] | None, now: datetime) -> dict[str, Any]:
    row = {"id": job.id, "name": job.name, "kind": job.kind, "gpus": job.gpus, "devices": job.devices,
           "started_at": job.started_at, "time_limit_s": job.time_limit_s,
           "cancel_requested": job.cancel_requested,
           "run_id": run["id"] if run else None, "run_name": run["name"] if run else None}
    total = run["total_steps"] if run else job.train_config().get("steps")
    row.update(progress(job.kind, job.started_at, now, job.time_limit_s, run, total))
    return row


def progress(kind: str, started_at: datetime | None, now: datetime, time_limit_s: float | None,
             run: dict[str, Any] | None, total_steps: int | None) -> dict[str, Any]:
    """How far a running job is. Pure. Returns {fraction (0..1 or None), step, total_steps,
    eta_s, elapsed_s, basis}, basis being:

    - "steps": a training job whose run has logged steps: step of total, and an ETA from the
      rate between its first and last logged steps (start-up excluded), counted from the last
      one (a run that went quiet gets no younger ETA);
    - "starting": a training job with no logged step yet (fraction 0; its total is known);
    - "time": a command job with a time limit: elapsed of the limit;
    - "elapsed": a command job without one (no fraction).
    """
    elapsed = _elapsed(started_at, now)
    out: dict[str, Any] = {"fraction": None, "step": None, "total_steps": total_steps,
                           "eta_s": None, "elapsed_s": elapsed, "basis": "elapsed"}
    if kind == "train":
        step = run["last_step"] if run else None
        if not step:
            out.update(basis="starting", step=0 if total_steps else None,
                       fraction=0.0 if total_steps else None)
            return out
        out.update(basis="steps", step=step)
        if total_steps:
            out["fraction"] = min(1.0, step / total_steps)
            first, last = run.get("first_step"), run.get("last_logged_step")
            t0, t1 = run.get("first_time"), run.get("last_time")
            if first is not None and last is not None and last > first and t0 and t1 and t1 > t0:
                rate = (last - first) / (t1 - t0).total_seconds()  # steps per second
                end = _ts(t1) + max(0, total_steps - last) / rate
                out["eta_s"] = max(0.0, end - now.timestamp())
        return out
    if time_limit_s and elapsed is not None:
        out.update(basis="time", fraction=min(1.0, elapsed / time_limit_s))
    return out


# ---- helpers ----

def _ts(moment: datetime) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _elapsed(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, _ts(end) - _ts(start))

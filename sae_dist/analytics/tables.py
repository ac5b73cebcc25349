"""The pages' tables as rows: one dict per row, column name to cell, built from plain data.

Pure functions (no Streamlit, no database), so what a table shows is testable with plain
dicts. Numbers are pre-formatted strings (through `sae_dist.format`) so that a missing one reads "—";
a progress stays a fraction (or None) and a time a datetime, for the page's progress-bar
and datetime columns.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sae_dist.analytics import jobs
from sae_dist.format import (
    MISSING,
    fmt_ago,
    fmt_bytes,
    fmt_duration,
    fmt_exit,
    fmt_number,
    fmt_seconds,
    fmt_share,
    fmt_steps,
    short_devices,
)

Row = dict[str, Any]


# ---- Overview: training runs ------------------------------------------------------------------

def runs_table(runs: list[Row], now: datetime) -> list[Row]:
    """The overview's table rows from `queries.list_runs` summaries (one dict per run)."""
    rows = []
    for run in runs:
        updated = run["last_update"]
        rows.append({  # the columns people scan first come first
            "id": run["id"],
            "name": run["name"],
            "status": run["status"],
            "steps": fmt_steps(run["last_step"], run["total_steps"]),
            "progress": run["progress"],
            "FVU": fmt_number(run["fvu"]),
            "L0": fmt_number(run["l0"], 3),
            "samples/s": fmt_number(run["samples_per_s"], 3),
            "world size": run["world_size"],
            "backend": run["backend"],
            "devices": short_devices(run["devices"]),
            "started": run["started_at"],
            "last update": fmt_ago(None if updated is None else (now - updated).total_seconds()),
        })
    return rows


# ---- Training runs and Monitor: ranks ---------------------------------------------------------

def ranks_table(ranks: list[Row]) -> list[Row]:
    """Each rank's summary (`queries.rank_summary`): timings, peak memory, straggler steps."""
    return [{"Rank": r["rank"], "Device": r["device"] or MISSING,
             "Steps logged": r["steps_logged"],
             "Mean step time": fmt_seconds(r["mean_step_time_s"]),
             "Mean compute time": fmt_seconds(r["mean_compute_time_s"]),
             "Peak memory": fmt_bytes(r["peak_memory_bytes"]),
             "Straggler steps": r["straggler_steps"]} for r in ranks]


def shares_table(window: list[Row]) -> list[Row]:
    """The latest window of each rank (`queries.latest_rank_window`) as table rows: its share
    of the step's batch beside its step and compute times; "—" where not recorded."""
    shares = [w["batch_size"] for w in window]
    # The global batch only when every share is known: a partial sum would mislead.
    total = sum(shares) if shares and all(s is not None for s in shares) else None
    return [{"Rank": w["rank"], "Device": w["device"] or MISSING,
             "Share": fmt_share(w["batch_size"], total),
             "Step time": fmt_seconds(w["step_time_s"]),
             "Compute time": fmt_seconds(w["compute_time_s"])} for w in window]


# ---- Queue ------------------------------------------------------------------------------------

def exit_cell(exit_code: int | None, signal: int | None) -> str:
    """A finished job's exit code or the signal that ended it (`format.fmt_exit`)."""
    return fmt_exit(exit_code, signal)


def running_rows(running: list[Row], runs: dict[int, Row], now: datetime) -> list[Row]:
    """The running jobs (`jobs.queue`), with their training run's progress where they have one
    (`runs`: `jobs.runs_by_job`)."""
    rows = []
    for j in running:
        run = runs.get(j["id"])
        rows.append({
            "Job": j["id"], "Task": _task(j), "Name": j["name"], "User": j["user"], "GPUs": j["gpus"],
            "Devices": short_devices(j["devices"]),
            "Progress": (min(run["last_step"] / run["total_steps"], 1.0)
                         if run is not None and run["total_steps"] else None),
            "Steps": fmt_steps(run["last_step"], run["total_steps"]) if run is not None else MISSING,
            "Elapsed": fmt_duration(jobs.elapsed_s(j, now)),
            "Time limit": fmt_duration(j["time_limit_s"]) if j["time_limit_s"] else "none",
            "Started": j["started_at"],
            "Note": "cancelling" if j["cancel_requested"] else "",
        })
    return rows


def pending_rows(pending: list[Row], now: datetime) -> list[Row]:
    """The pending jobs in the order they would start, with why each waits, in words (last, as
    squeue's NODELIST(REASON): the one column of any length)."""
    return [{
        "Job": j["id"], "Task": _task(j), "Name": j["name"], "User": j["user"], "GPUs": j["gpus"],
        "Tasks": j.get("task_count", 1), "Priority": j["priority"],
        "Waiting": fmt_duration((now - j["submitted_at"]).total_seconds()),
        "Submitted": j["submitted_at"], "Expected start": j.get("expected_start_at"),
        "Reason": jobs.explain_reason(j["reason"]),
    } for j in pending]


def finished_rows(finished: list[Row], now: datetime) -> list[Row]:
    """The finished jobs, newest first, with their final state and exit code."""
    return [{
        "Job": j["id"], "Task": _task(j), "Name": j["name"], "State": j["state"],
        "Exit": exit_cell(j["exit_code"], j["signal"]),
        "GPUs": j["gpus"], "Elapsed": fmt_duration(jobs.elapsed_s(j, now)),
        "Ended": j["ended_at"], "Reason": j["reason"] or "",
    } for j in finished]


def attempt_rows(job: Row) -> list[Row]:
    """A requeued job's earlier runs (preempted, or requeued after a failure), oldest first, as
    `acct -D` lists them; [] for a job that ran once or not yet."""
    import json

    from sae_dist.job_listing import attempt_times

    rows = []
    for n, a in enumerate(json.loads(job.get("attempts_json") or "[]"), 1):
        start, end, elapsed_s = attempt_times(a)
        rows.append({"Run": n, "State": a["state"], "Exit": exit_cell(a.get("exit_code"), a.get("signal")),
                     "Started": start, "Ended": end,
                     "Elapsed": fmt_duration(elapsed_s) if elapsed_s is not None else "—",
                     "Reason": a.get("reason") or ""})
    return rows


# A column whose every cell reads this says nothing: no array task, no pending task folded in, no
# note. `drop_quiet_columns` leaves it out, so that the columns that speak fit a laptop's window.
QUIET_CELLS = {"Task": "", "Tasks": 1, "Note": "", "Expected start": None}


def drop_quiet_columns(rows: list[Row], quiet: dict[str, Any] = QUIET_CELLS) -> list[Row]:
    """`rows` without the columns in which every row holds its quiet value (`QUIET_CELLS`)."""
    drop = {c for c, value in quiet.items() if rows and all(c in r and r[c] == value for r in rows)}
    return [{c: v for c, v in r.items() if c not in drop} for r in rows] if drop else rows


def _task(job: Row) -> str:
    """An array task's name (12_7, or the folded 12_[3-999%8] of pending ones); "" for a plain job."""
    return job.get("label", "") if job.get("array_job_id") is not None else ""


ARRAY_COUNTED = ("PENDING", "RUNNING", "COMPLETED")


def array_rows(arrays: list[Row]) -> list[Row]:
    """Job arrays (`jobs.array_progress`) with their progress: the share of tasks ended, and
    how many are pending, running, completed and ended otherwise (failed, cancelled...)."""
    rows = []
    for a in arrays:
        states = a["states"]
        total = sum(states.values())
        ended = total - states.get("PENDING", 0) - states.get("RUNNING", 0)
        rows.append({
            "Array": a["array_id"], "Name": a["name"], "Tasks": total,
            "At once": f"at most {a['max_running']}" if a["max_running"] else "no limit",
            "Progress": ended / total if total else None,
            "Pending": states.get("PENDING", 0), "Running": states.get("RUNNING", 0),
            "Completed": states.get("COMPLETED", 0),
            "Not completed": sum(n for state, n in states.items() if state not in ARRAY_COUNTED),
        })
    return rows


def cluster_rows(cluster_jobs: list[Any]) -> list[Row]:
    """Jobs handed to the SLURM cluster (ClusterJob rows, oldest first), newest first."""
    return [{
        "Job": f"slurm:{j.cluster_job_id}", "Name": j.name, "User": j.user, "Kind": j.kind, "State": j.state,
        "Exit": exit_cell(j.exit_code, j.signal),
        "Started": j.started_at, "Ended": j.ended_at,
    } for j in reversed(cluster_jobs)]

"""What a person can do to a job, shared by the CLI and the app: cancel, hold, release, requeue.

Each action changes the database through `scheduler.store` (one locked transaction) and then
tells the processes concerned: a running job's supervisor gets SIGTERM (it ends the job's
processes, SIGKILL after its grace period) and the daemon is woken for a scheduling pass.
Each returns the one line the CLI prints; a refusal (not found, wrong state) is a UserError.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

from sqlalchemy.engine import Engine

from scheduler import procs, store
from scheduler.control import wake_daemon

ACTIONS = ("cancel", "hold", "release", "requeue")


def signal_supervisor(job) -> None:
    """SIGTERM to a running job's supervisor, if it is still the process that was recorded."""
    if procs.is_alive(job.supervisor_pid, job.supervisor_start_ticks):
        try:
            os.kill(job.supervisor_pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended between the check and the signal
            pass


def cancel(engine: Engine, job_id: int) -> str:
    """A pending job is cancelled at once; a running one is stopped by its supervisor."""
    outcome = store.cancel(engine, job_id)
    if outcome == "requested":
        signal_supervisor(store.get_job(engine, job_id))
        return f"job {job_id}: cancelling (SIGTERM, SIGKILL after the grace period)"
    if outcome == "cancelled":
        return f"job {job_id}: cancelled"
    return f"job {job_id}: already {outcome}"


def hold(engine: Engine, job_id: int) -> str:
    """Keep a pending job from starting."""
    store.set_held(engine, job_id, True)
    return f"job {job_id}: held"


def release(engine: Engine, job_id: int) -> str:
    """Let a held job start."""
    store.set_held(engine, job_id, False)
    return f"job {job_id}: released"


def requeue(engine: Engine, job_id: int) -> str:
    """A finished job goes back to the queue; a running one is stopped first, then requeued."""
    if store.requeue(engine, job_id) == "requested":
        signal_supervisor(store.get_job(engine, job_id))
        return f"job {job_id}: stopping, then back in the queue"
    return f"job {job_id}: requeued"


_BY_NAME: dict[str, Callable[[Engine, int], str]] = {
    "cancel": cancel, "hold": hold, "release": release, "requeue": requeue}


def perform(engine: Engine, action: str, job_id: int, wake: bool = True) -> str:
    """Do `action` (one of ACTIONS) on a job, then wake the daemon (unless `wake=False`, for
    callers doing several). Returns the action's line."""
    if action not in _BY_NAME:
        raise ValueError(f"unknown action {action!r}; one of {', '.join(ACTIONS)}")
    try:
        return _BY_NAME[action](engine, job_id)
    finally:
        if wake:
            wake_daemon()


def available(state: str, held: bool, cancel_requested: bool = False) -> dict[str, str | None]:
    """For a job in `state`: each action, None when it can be done, else why not (a line)."""
    pending, running = state == "PENDING", state == "RUNNING"
    return {
        "cancel": None if (pending or (running and not cancel_requested)) else
        ("already being cancelled" if running else f"it already ended ({state})"),
        "hold": None if pending and not held else
        ("it is already held" if pending else "only a pending job can be held"),
        "release": None if pending and held else
        ("it is not held" if pending else "only a held pending job can be released"),
        # A finished job keeps its cancel flag (requeue clears it); only a running one waits on it.
        "requeue": None if not pending and not (running and cancel_requested) else
        ("it is already in the queue" if pending else "it is being cancelled"),
    }

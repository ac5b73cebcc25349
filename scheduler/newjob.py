"""A job's row at submission, built from a validated JobSpec: shared by the SQLAlchemy store and
the lean standard-library submit (`scheduler.quick_submit`), so both store the same columns.

Imports no database code: `submit` from the CLI must start in a fraction of a second.
"""

from __future__ import annotations

import functools
import getpass
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sae_dist.errors import UserError
from scheduler.spec import JobSpec, resolve_devices, resolve_gpus


@dataclass(frozen=True)
class NewJob:
    """The columns of a job at submission (built from a validated scheduler.spec.JobSpec)."""

    name: str
    kind: str
    argv: list[str]
    gpus: int
    workdir: str
    train_config: dict | None = None
    gpu_ids: list[str] | None = None  # device uuids
    mem_per_gpu: int | None = None
    priority: int = 0
    time_limit_s: float | None = None
    begin_at: datetime | None = None
    dependencies: tuple[tuple[str, int], ...] = ()
    held: bool = False
    requeue: bool = False
    exclusive: bool = False  # holds every device while it runs (SLURM's --exclusive)
    env: dict[str, str] | None = None
    stdout: str | None = None
    stderr: str | None = None
    array_max_running: int | None = None  # a job array's %N (its tasks share this NewJob or differ by config)
    snapshot_commit: str | None = None  # submit --snapshot: the commit queued, and the copy it runs in
    snapshot_dir: str | None = None
    shared: bool = False  # beside other shared jobs on a GPU while their declared memory fits it
    preemptible: bool = False  # a job of higher priority may take its devices (it is requeued)
    preempt_grace_s: float | None = None


def new_job(spec: JobSpec, devices: list[tuple[int, str]]) -> NewJob:
    """The row to store for `spec` on this machine's devices, (index, uuid): its device ids as
    uuids and its count resolved (an exclusive job's default is every device)."""
    uuids = resolve_devices(spec, devices)
    return NewJob(
        name=spec.name, kind=spec.kind, argv=spec.argv, gpus=resolve_gpus(spec, devices), workdir=spec.workdir,
        train_config=spec.train_config, gpu_ids=uuids, mem_per_gpu=spec.mem_per_gpu,
        priority=spec.priority, time_limit_s=spec.time_limit_s, begin_at=spec.begin_at,
        dependencies=tuple(spec.dependencies), held=spec.held, requeue=spec.requeue,
        exclusive=spec.exclusive, env=spec.stored_env(), stdout=spec.stdout, stderr=spec.stderr,
        snapshot_commit=spec.snapshot.commit if spec.snapshot else None,
        snapshot_dir=spec.snapshot.workdir if spec.snapshot else None,
        preemptible=spec.preemptible, preempt_grace_s=spec.preempt_grace_s, shared=spec.shared)


def job_row(job: NewJob, now: datetime) -> dict:
    """The `jobs` columns of a new PENDING job (times as given: aware datetimes)."""
    return {
        "name": job.name, "user": current_user(), "kind": job.kind, "argv_json": json.dumps(job.argv),
        "train_config_json": json.dumps(job.train_config) if job.train_config is not None else None,
        "state": "PENDING", "reason": "JobHeldUser" if job.held else None, "priority": job.priority,
        "gpus": job.gpus, "gpu_ids_json": json.dumps(job.gpu_ids) if job.gpu_ids else None,
        "mem_per_gpu": job.mem_per_gpu, "time_limit_s": job.time_limit_s, "begin_at": job.begin_at,
        "dependencies_json": json.dumps([list(d) for d in job.dependencies]), "held": job.held,
        "exclusive": job.exclusive, "requeue_on_failure": job.requeue, "requeue_count": 0, "workdir": job.workdir,
        "env_json": json.dumps(job.env or {}), "stdout_pattern": job.stdout, "stderr_pattern": job.stderr,
        "cancel_requested": False, "submitted_at": now,
        # An array's tasks: their task id (array_submit.task_rows) and array id (known once stored).
        "array_job_id": None, "array_task_id": None, "array_max_running": job.array_max_running,
        "snapshot_commit": job.snapshot_commit, "snapshot_dir": job.snapshot_dir,
        "preemptible": job.preemptible, "preempt_grace_s": job.preempt_grace_s, "shared": job.shared,
    }


def check_dependencies_found(wanted: Iterable[int], found: Iterable[int]) -> None:
    """The one error for a dependency on a job that does not exist (the lowest such id)."""
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise UserError(f"unknown dependency: job {missing[0]} does not exist (see `queue --all`)")


@functools.cache
def current_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "unknown"

"""The rows one submit stores: one job, or for `submit --array` a task per task id, alike but
for the task id, or for a training with `[[array]]` tables in its TOML each with its own
overrides (a sweep in one submit).

Pure (no database): the stores insert the rows in one transaction and give every task the first
task's id as the array's id.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from sae_dist.contract.sweep_argv import SWEEP_KEY, swept_keys
from sae_dist.errors import UserError
from scheduler.arrays import ArraySpec
from scheduler.newjob import NewJob, job_row, new_job
from scheduler.spec import JobSpec

ARRAY_TABLE = "array"
"""The TOML key of the per-task overrides: `[[array]]` tables, one per task id 0, 1, 2..."""


def jobs_to_store(spec: JobSpec, devices: list[tuple[int, str]], array=None,
                  overrides: list[dict] | None = None) -> list[tuple[int | None, NewJob]]:
    """The rows one submit stores, as (task id, job): the job (task id None), or with `array` (a
    scheduler.arrays.ArraySpec) one per task; tasks alike but for their
    id share one NewJob, so a 10,000-task array builds one row and copies it."""
    if array is None:
        return [(None, new_job(spec, devices))]
    tasks = array_jobs(spec, array, devices, overrides)
    check_distinct_out_dirs(tasks)
    return tasks


def task_rows(tasks: list[tuple[int | None, NewJob]], now: datetime, encode=lambda row: row) -> list[dict]:
    """The `jobs` rows of (task id, job) pairs, `encode`d (e.g. for a driver); a job shared by
    several tasks is built once."""
    built: dict[int, dict] = {}
    rows = []
    for task_id, job in tasks:
        if id(job) not in built:
            built[id(job)] = encode(job_row(job, now))
        rows.append({**built[id(job)], "array_task_id": task_id})
    return rows


def array_from_overrides(overrides: list[dict[str, Any]], given: ArraySpec | None) -> ArraySpec:
    """The tasks of a training whose TOML has `[[array]]` tables: every entry (0..N-1), or those
    `--array` names, each of which must index an entry."""
    if not overrides:
        raise UserError("--train: [[array]] has no entries; give one table per task or drop it")
    if given is None:
        return ArraySpec(tuple(range(len(overrides))))
    beyond = [t for t in given.task_ids if t >= len(overrides)]
    if beyond:
        raise UserError(f"--array {given}: task {beyond[0]} has no [[array]] entry in the TOML "
                        f"({len(overrides)} entries: task ids 0-{len(overrides) - 1})")
    return given


def array_jobs(spec: JobSpec, array: ArraySpec, devices: list[tuple[int, str]],
               overrides: list[dict[str, Any]] | None = None) -> list[tuple[int, NewJob]]:
    """(task id, job) per task of `array`, in task order. A command's tasks share one job; a
    training's each get their own run name (`<name>-<task>`, unless an override names it) so
    their run directories differ."""
    if overrides is not None:
        return [(task, _override_task(spec, task, overrides[task], array, devices)) for task in array.task_ids]
    base = replace(new_job(spec, devices), array_max_running=array.max_running)
    if base.train_config is None:
        return [(task, base) for task in array.task_ids]
    return [(task, replace(base, train_config=_task_config(base.train_config, spec.name, task, {})))
            for task in array.task_ids]


def _override_task(spec: JobSpec, task: int, override: Any, array: ArraySpec,
                   devices: list[tuple[int, str]]) -> NewJob:
    if not isinstance(override, dict):
        raise UserError(f"--train: [[array]] entry {task} must be a table of settings")
    if "devices" in override:  # the tasks share --gpus: one device count for the whole array
        raise UserError(f"--train: [[array]] entry {task}: devices cannot differ between tasks of an array; "
                        "set it once outside [[array]]")
    swept = sorted(set(override) & set(swept_keys((spec.train_config or {}).get(SWEEP_KEY))))
    if swept:  # the task's sweep would set it anyway: say so rather than drop the override
        raise UserError(f"--train: [[array]] entry {task}: {swept[0]} is swept in every task ([sweep]); "
                        "set it in one of the two")
    config = _task_config(spec.train_config, spec.name, task, override)
    try:
        task_spec = replace(spec, train_config=config)  # validated again, with the override
    except UserError as e:
        raise UserError(f"--train: [[array]] entry {task}: {str(e).removeprefix('--train: ')}") from None
    return replace(new_job(task_spec, devices), array_max_running=array.max_running)


def task_configs(spec: JobSpec, array: ArraySpec) -> dict[int, dict]:
    """A training array's config per task (for SLURM's script: no device of this machine involved)."""
    return {task: _task_config(spec.train_config, spec.name, task, {}) for task in array.task_ids}


def _task_config(config: dict | None, job_name: str | None, task: int, override: dict) -> dict | None:
    """A task's training config: the shared one with its overrides, named apart from the others."""
    if config is None:
        return None
    merged = {**config, **override}
    if "name" not in override:
        merged["name"] = f"{config.get('name') or job_name or 'train'}-{task}"
    return merged


def check_distinct_out_dirs(tasks: list[tuple[int, NewJob]]) -> None:
    """Tasks of a training array that would write into one run directory are refused."""
    seen: dict[str, int] = {}
    for task, job in tasks:
        out_dir = (job.train_config or {}).get("out_dir")
        if out_dir is None:
            continue
        if out_dir in seen:
            raise UserError(f"--train: tasks {seen[out_dir]} and {task} of the array would both write to "
                            f"out_dir {out_dir}; set out_dir in each [[array]] entry or leave it out")
        seen[out_dir] = task

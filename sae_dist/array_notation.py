"""Job arrays written as SLURM writes them, for every listing (the CLI's `queue`, the app's
Queue page): task ids folded into ranges (`0-3,7,9,10`), and the pending tasks of an array
named as one row (`12_[3-999%8]`; which tasks fold together is `job_listing.pending_task_groups`).
Pure, and a leaf: any layer may use it.
"""

from __future__ import annotations


def fold_ids(ids) -> str:
    """Task ids in the `--array` notation, shortest first: runs of 3 or more consecutive ids
    as A-B, the rest one by one: [0, 1, 2, 3, 7, 9, 10] -> "0-3,7,9,10"."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(n) for n in ordered[i:j + 1])
        i = j + 1
    return ",".join(parts)


def task_label(job_id: int, array_job_id: int | None, array_task_id: int | None) -> str:
    """How listings name a job: 12_7 for task 7 of array 12 (squeue's notation), else its id."""
    return str(job_id) if array_job_id is None else f"{array_job_id}_{array_task_id}"


def label_rows(rows: list[dict], groups: dict[int, list[int]], id_key: str = "job_id") -> list[dict]:
    """Give each listing row its `label` and `task_count`: a pending row that stands for a
    group of an array's pending tasks (`groups`: its job id -> the group's task ids, from
    `job_listing.pending_task_groups`) reads `12_[3-999%8]`, as squeue folds them; any other
    row 12_7 (a task) or 12 (a job), counting 1. A row has `id_key`, `state`, `array_job_id`,
    `array_task_id` and `array_max_running`. Labelled in place; returned for convenience."""
    for row in rows:
        tasks = groups.get(row[id_key]) if row["state"] == "PENDING" else None
        row["label"] = folded_label(row["array_job_id"], tasks, row.get("array_max_running")) if tasks \
            else task_label(row[id_key], row.get("array_job_id"), row.get("array_task_id"))
        row["task_count"] = len(tasks) if tasks else 1
    return rows


def folded_label(array_id: int, tasks: list[int], max_running: int | None) -> str:
    """Pending tasks of an array as squeue names them together: 12_[3-999%8] (12_3 for one task
    of an array without a limit)."""
    limit = f"%{max_running}" if max_running else ""
    if len(tasks) == 1 and not limit:
        return f"{array_id}_{tasks[0]}"
    return f"{array_id}_[{fold_ids(tasks)}{limit}]"

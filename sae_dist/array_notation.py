"""Job arrays written as SLURM writes them, for every listing (the CLI's `queue`, the app's
Queue page): task ids folded into ranges (`0-3,7,9,10`), and the pending tasks of an array
folded into one row (`12_[3-999%8]`). Pure, and a leaf: any layer may use it.
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


def fold_pending_tasks(rows: list[dict], id_key: str = "job_id") -> list[dict]:
    """Rows (in their order) with the pending tasks of each array folded into one row, as
    squeue shows them: `12_[3-999%8]`, at the place of the first. Tasks fold together only
    when they wait for the same reason and hold, so no row says of a task what is not so.
    A row has `id_key`, `state`, `reason`, `held`, `array_job_id`, `array_task_id` and
    `array_max_running`; each row comes back with a `label` (12, 12_7 or the folded name)
    and a `task_count` (1, or the tasks folded into it)."""
    groups: dict[tuple, list[int]] = {}
    out: list[dict] = []
    for row in rows:
        array_id = row.get("array_job_id")
        if array_id is None or row["state"] != "PENDING":
            out.append({**row, "label": task_label(row[id_key], array_id, row.get("array_task_id")),
                        "task_count": 1})
            continue
        key = (array_id, row["reason"], row["held"])
        if key not in groups:
            groups[key] = []
            out.append({**row, "folded": groups[key]})
        groups[key].append(row["array_task_id"])
    for row in out:
        tasks = row.pop("folded", None)
        if tasks is not None:
            row["label"] = folded_label(row["array_job_id"], tasks, row.get("array_max_running"))
            row["task_count"] = len(tasks)
    return out


def folded_label(array_id: int, tasks: list[int], max_running: int | None) -> str:
    """Pending tasks of an array as squeue names them together: 12_[3-999%8] (12_3 for one task
    of an array without a limit)."""
    limit = f"%{max_running}" if max_running else ""
    if len(tasks) == 1 and not limit:
        return f"{array_id}_{tasks[0]}"
    return f"{array_id}_[{fold_ids(tasks)}{limit}]"

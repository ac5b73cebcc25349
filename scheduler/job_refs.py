"""Commands on jobs named as SLURM names them: `12` (a job, or every task of array 12),
`12_7` (one task), `12_[3-5]` (some tasks). Resolves the names to job ids with one read each,
and acts on a whole array in one transaction (cancelling 10,000 tasks is one write, not 10,000).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from sae_dist.errors import UserError
from sae_dist.job_listing import MAX_ID, query
from scheduler.arrays import JobRef, fold_ids, parse_job_ref

if TYPE_CHECKING:  # acct reads through here: SQLAlchemy costs a process ~0.4 s
    from sqlalchemy.engine import Engine


def resolve(ref: JobRef, engine=None) -> list[int]:
    """The job ids `ref` names: a job, or every task of an array (its id), or the tasks named.
    A job id that names nothing is returned as it is: the action says there is no such job."""
    if ref.tasks is None:
        rows = query('SELECT "id" FROM "jobs" WHERE "array_job_id" = :a ORDER BY "array_task_id"',
                     {"a": ref.job_id}, engine)
        return [r[0] for r in rows] or [ref.job_id]
    rows = query('SELECT "array_task_id", "id" FROM "jobs" WHERE "array_job_id" = :a', {"a": ref.job_id}, engine)
    if not rows:
        raise UserError(f"no job array {ref.job_id} (see `queue --all`)")
    by_task = dict(rows)
    missing = [t for t in ref.tasks if t not in by_task]
    if missing:
        raise UserError(f"no task {ref.job_id}_{missing[0]}: array {ref.job_id} has tasks "
                        f"{fold_ids(by_task)}")
    return [by_task[t] for t in ref.tasks]


def act_on_tasks(engine: Engine, action: str, ref: JobRef, ids: list[int]) -> str:
    """`action` on several tasks of an array at once; one line saying what became of them."""
    from scheduler import actions, store

    if action == "cancel":
        outcomes, words = cancel_jobs(engine, ids), CANCEL_WORDS
    elif action in ("hold", "release"):
        outcomes = store.set_held_many(engine, ids, action == "hold")
        words = {"done": "held" if action == "hold" else "released"}
    else:  # requeue: rare on many tasks; one task at a time, each as `requeue N` would
        outcomes = {}
        for job_id in ids:
            try:
                outcomes[job_id] = store.requeue(engine, job_id)
            except UserError:
                outcomes[job_id] = "PENDING"
            if outcomes[job_id] == "requested":
                actions.signal_supervisor(store.get_job(engine, job_id))
        words = {"requeued": "requeued", "requested": "stopping, then back in the queue"}
    return f"{ref}: " + summary(outcomes, words)


CANCEL_WORDS = {"cancelled": "cancelled", "requested": "cancelling (SIGTERM, SIGKILL after the grace period)"}


def cancel_jobs(engine: Engine, ids: list[int]) -> dict[int, str]:
    """Cancel many jobs in one transaction, and signal the supervisors of the running ones:
    id -> "cancelled", "requested" or the final state it already had."""
    from scheduler import actions, store

    outcomes = store.cancel_many(engine, ids)
    for job in store.jobs_by_id(engine, [i for i, o in outcomes.items() if o == "requested"]):
        actions.signal_supervisor(job)
    return outcomes


def summary(outcomes: dict[int, str], words: dict[str, str], noun: str = "task") -> str:
    """'950 tasks cancelled, 42 tasks left as they are (COMPLETED)': counts of each outcome, the
    done ones first."""
    counts = Counter(outcomes.values())

    def some(n: int) -> str:
        return f"{n} {noun}" + ("" if n == 1 else "s")

    parts = [f"{some(counts[o])} {w}" for o, w in words.items() if counts[o]]
    parts += [f"{some(n)} left as they are ({state})" for state, n in sorted(counts.items()) if state not in words]
    return ", ".join(parts) or f"no {noun}"


def listed_jobs(text: str) -> tuple[list[int], list[int]]:
    """`acct -j`'s list (3,5,12_7,12_[0-3]): the job ids, and the ids whose array tasks are
    wanted too (an array's id names the whole array, as in sacct). A filter: an id no job has
    matches nothing; one no job can have (past the database's integers) is refused, as cancel
    refuses it."""
    ids: set[int] = set()
    whole: set[int] = set()
    for part in split_refs(text):
        try:
            ref = parse_job_ref(part)
        except UserError:
            raise UserError(f"--jobs: {text!r} is not a list of job ids; write e.g. 3,5 or 12_7 "
                            "(task 7 of array 12)") from None
        if ref.job_id > MAX_ID:
            raise UserError(f"--jobs: no job {ref.job_id}: job ids go up to {MAX_ID}")
        if ref.tasks is None:
            ids.add(ref.job_id)
            whole.add(ref.job_id)
        else:
            ids.update(resolve(ref))
    return sorted(ids), sorted(whole)


def split_refs(text: str) -> list[str]:
    """'3,12_[0-3,7],5' -> ['3', '12_[0-3,7]', '5']: commas inside brackets stay."""
    parts, depth, current = [], 0, ""
    for c in text:
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += c
    return parts + [current.strip()]

"""Job arrays as SLURM writes them: `--array 0-999%8`, `1,3,5`, `0-15:4`; pure, no I/O.

An array is one submit of many tasks that differ only by their task id. `parse_array` reads
the `--array` text (ranges, lists, steps, and `%N` for the most tasks running at once);
`fold_ids` writes a set of task ids back in that notation, the way `squeue` folds pending
tasks (`12_[3-999%8]`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sae_dist.array_notation import fold_ids, folded_label  # fold_ids: scheduler code imports it from here
from sae_dist.errors import UserError

MAX_TASK_ID = 1_000_000
"""The largest task id accepted (SLURM's MaxArraySize is configurable; ours is fixed)."""
MAX_TASKS = 100_000
"""The most tasks one array may have: one transaction stores them all."""


@dataclass(frozen=True)
class ArraySpec:
    task_ids: tuple[int, ...]  # ascending, no repeats
    max_running: int | None = None  # `%N`: at most N tasks of the array run at once

    def __str__(self) -> str:
        return fold_ids(self.task_ids) + (f"%{self.max_running}" if self.max_running else "")


def parse_array(text: str) -> ArraySpec:
    """`--array`'s value: comma-separated ids and ranges (`A-B`, `A-B:STEP`), then `%N`."""
    spec, _, limit = text.strip().partition("%")
    if not spec:
        raise UserError(f"--array {text!r}: give task ids such as 0-99, 1,3,5 or 0-15:4 "
                        f"(then %N to run at most N at once)")
    ids: set[int] = set()
    for part in spec.split(","):
        ids.update(_part(part.strip(), text))
        if len(ids) > MAX_TASKS:
            raise UserError(f"--array {text!r}: more than {MAX_TASKS:,} tasks in one array")
    return ArraySpec(tuple(sorted(ids)), _limit(limit, text) if limit or "%" in text else None)


def _part(part: str, text: str) -> range:
    span, _, step_text = part.partition(":")
    first_text, dash, last_text = span.partition("-")
    first = _number(first_text, "task id", text)
    last = _number(last_text, "task id", text) if dash else first
    step = _number(step_text, "step", text) if step_text or ":" in part else 1
    if step_text and not dash:
        raise UserError(f"--array {text!r}: a step ({part}) belongs to a range such as 0-15:4")
    if last < first:
        raise UserError(f"--array {text!r}: the range {span} ends before it starts")
    if last > MAX_TASK_ID:
        raise UserError(f"--array {text!r}: task ids go up to {MAX_TASK_ID:,}")
    if step < 1:
        raise UserError(f"--array {text!r}: the step in {part} must be 1 or more")
    return range(first, last + 1, step)


def _number(word: str, what: str, text: str) -> int:
    if not (word.isascii() and word.isdigit()):  # int() takes "０" and "٣" too
        raise UserError(f"--array {text!r}: {word!r} is not a {what} (a whole number, 0 or more)")
    return int(word)


def _limit(word: str, text: str) -> int:
    limit = _number(word, "limit after %", text)
    if limit < 1:
        raise UserError(f"--array {text!r}: %{word} must let at least 1 task run")
    if limit > MAX_TASKS:
        raise UserError(f"--array {text!r}: %{word} is more than the {MAX_TASKS:,} tasks an array may have")
    return limit


# ---- naming tasks: 12 (a job, or a whole array), 12_7 (one task), 12_[3-5] (some tasks) ----

@dataclass(frozen=True)
class JobRef:
    """A job as a command names it: `job_id` alone (a job, or every task when it is an array's
    id), or with `tasks` (those task ids of array `job_id`)."""

    job_id: int
    tasks: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return str(self.job_id) if self.tasks is None else folded_label(self.job_id, list(self.tasks), None)


def parse_job_ref(text: str, max_id: int | None = None) -> JobRef:
    """`12`, `12_7` or `12_[3-5,9]` (squeue's notation), checked: ids positive (and at most
    `max_id` when given), task ids as `--array` takes them (no %N)."""
    head, underscore, tail = text.partition("_")
    if not (head.isascii() and head.isdigit()) or int(head) < 1:
        raise UserError(f"job id must be a positive number (or ARRAY_TASK, e.g. 12_7 or 12_[3-5]), got {text!r}")
    if max_id is not None and int(head) > max_id:
        raise UserError(f"no job {head}: job ids go up to {max_id}")
    if not underscore:
        return JobRef(int(head))
    inner = tail[1:-1] if tail.startswith("[") and tail.endswith("]") else tail
    if not inner or "%" in inner or (inner == tail and not (tail.isascii() and tail.isdigit())):
        raise UserError(f"{text!r}: write one task as {head}_7 or several as {head}_[3-5,9]")
    try:
        spec = parse_array(inner)
    except UserError as e:
        raise UserError(f"{text!r}: {str(e).split(': ', 1)[-1]}") from None
    return JobRef(int(head), spec.task_ids)


def array_state(states) -> str | None:
    """The state a dependency on a whole array sees, from its tasks' states: None (still live)
    while any task is pending or running; then COMPLETED when every task completed, else
    FAILED (some task did not), so afterok waits for all tasks, afterany for all to end."""
    states = list(states)
    if not states or any(s in ("PENDING", "RUNNING") for s in states):
        return None
    return "COMPLETED" if all(s == "COMPLETED" for s in states) else "FAILED"


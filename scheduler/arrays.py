"""Job arrays as SLURM writes them: `--array 0-999%8`, `1,3,5`, `0-15:4`; pure, no I/O.

An array is one submit of many tasks that differ only by their task id. `parse_array` reads
the `--array` text (ranges, lists, steps, and `%N` for the most tasks running at once);
`fold_ids` writes a set of task ids back in that notation, the way `squeue` folds pending
tasks (`12_[3-999%8]`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        raise UserError(f"--array {text!r}: give task ids such as 0-99, 1,3,5 or 0-15:4 (then %N to run at most N at once)")
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
    if not word.isdigit():
        raise UserError(f"--array {text!r}: {word!r} is not a {what} (a whole number, 0 or more)")
    return int(word)


def _limit(word: str, text: str) -> int:
    limit = _number(word, "limit after %", text)
    if limit < 1:
        raise UserError(f"--array {text!r}: %{word} must let at least 1 task run")
    return limit


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

"""`--array`'s notation, read and written back (scheduler/arrays.py): plain data, no processes."""

from __future__ import annotations

import pytest

from sae_dist.errors import UserError
from scheduler.arrays import MAX_TASK_ID, ArraySpec, fold_ids, parse_array


@pytest.mark.parametrize("text, ids, limit", [
    ("0-3", (0, 1, 2, 3), None),
    ("7", (7,), None),
    ("1,3,5", (1, 3, 5), None),
    ("0-15:4", (0, 4, 8, 12), None),
    ("0-999%8", tuple(range(1000)), 8),
    ("5,0-2,2-3", (0, 1, 2, 3, 5), None),  # overlaps counted once, in order
    (" 1-2%1 ", (1, 2), 1),
])
def test_slurm_array_notation(text, ids, limit):
    assert parse_array(text) == ArraySpec(ids, limit)


@pytest.mark.parametrize("text, message", [
    ("", "give task ids such as 0-99"),
    ("%4", "give task ids such as 0-99"),
    ("a-3", "'a' is not a task id"),
    ("3-1", "the range 3-1 ends before it starts"),
    ("0-15:0", "the step in 0-15:0 must be 1 or more"),
    ("0-15:", "'' is not a step"),
    ("4:2", "a step (4:2) belongs to a range"),
    ("0-3%0", "%0 must let at least 1 task run"),
    ("0-3%", "'' is not a limit after %"),
    ("1,,2", "'' is not a task id"),
    ("-1", "'' is not a task id"),
    (f"0-{MAX_TASK_ID + 1}", f"task ids go up to {MAX_TASK_ID:,}"),
    ("0-200000", "more than 100,000 tasks in one array"),
])
def test_bad_array_text_is_one_clear_error(text, message):
    with pytest.raises(UserError, match="--array") as e:
        parse_array(text)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("ids, folded", [
    ([], ""),
    ([4], "4"),
    ([0, 1], "0,1"),
    ([0, 1, 2, 3, 7, 9, 10], "0-3,7,9,10"),
    ([10, 3, 4, 5, 3], "3-5,10"),
])
def test_task_ids_fold_as_squeue_writes_them(ids, folded):
    assert fold_ids(ids) == folded


def test_folding_reads_back_to_the_same_tasks():
    spec = parse_array("0-40:3,41,42,43,100-120%5")
    assert str(spec) == "0,3,6,9,12,15,18,21,24,27,30,33,36,39,41-43,100-120%5"
    assert parse_array(str(spec)) == spec

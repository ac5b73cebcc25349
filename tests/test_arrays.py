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


# ---- naming tasks, array states, folding (pure) ------------------------------------------------

from sae_dist.array_notation import label_rows  # noqa: E402
from scheduler.arrays import JobRef, array_state, parse_job_ref  # noqa: E402


@pytest.mark.parametrize("text, ref", [
    ("12", JobRef(12)),
    ("12_7", JobRef(12, (7,))),
    ("12_[3-5]", JobRef(12, (3, 4, 5))),
    ("12_[9,1-2]", JobRef(12, (1, 2, 9))),
])
def test_jobs_are_named_as_squeue_names_them(text, ref):
    assert parse_job_ref(text, 2**63 - 1) == ref
    assert parse_job_ref(str(ref)) == ref  # written back as read


@pytest.mark.parametrize("text, message", [
    ("", "job id must be a positive number"),
    ("0", "job id must be a positive number"),
    ("x_1", "job id must be a positive number"),
    ("12_", "write one task as 12_7"),
    ("12_x", "write one task as 12_7"),
    ("12_[]", "write one task as 12_7"),
    ("12_[1-4%2]", "write one task as 12_7"),  # %N belongs to submit
    ("12_[4-1]", "the range 4-1 ends before it starts"),
    (str(2**63), "job ids go up to"),
])
def test_a_bad_job_name_is_one_clear_error(text, message):
    with pytest.raises(UserError) as e:
        parse_job_ref(text, 2**63 - 1)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("states, seen", [
    (["COMPLETED", "RUNNING"], None),  # live until every task ended
    (["PENDING"], None),
    (["COMPLETED", "COMPLETED"], "COMPLETED"),
    (["COMPLETED", "FAILED"], "FAILED"),  # afterok never, afternotok yes, afterany yes
    (["CANCELLED"], "FAILED"),
])
def test_a_dependency_on_an_array_sees_all_its_tasks(states, seen):
    assert array_state(states) == seen


def _row(job_id, state, array=None, task=None, limit=None):
    return {"job_id": job_id, "state": state, "array_job_id": array, "array_task_id": task,
            "array_max_running": limit}


def test_listing_rows_are_named_as_squeue_names_them():
    # Pending groups (job_listing.pending_task_groups): the row of job 12 stands for tasks 2-5
    # and 9 of array 10; the row of job 31 for task 0 of array 31 alone.
    groups = {12: [2, 3, 4, 5, 9], 31: [0]}
    rows = [_row(10, "RUNNING", 10, 0, limit=2), _row(11, "COMPLETED", 10, 1, limit=2),
            _row(12, "PENDING", 10, 2, limit=2), _row(30, "PENDING"), _row(31, "PENDING", 31, 0),
            _row(40, "PENDING", 40, 0, limit=1)]
    labelled = label_rows(rows, groups)
    assert labelled is rows
    assert [(r["label"], r["task_count"]) for r in rows] == [
        ("10_0", 1), ("10_1", 1), ("10_[2-5,9%2]", 5), ("30", 1), ("31_0", 1), ("40_0", 1)]
    assert label_rows([_row(12, "RUNNING", 10, 2, limit=2)], groups)[0]["label"] == "10_2"  # running: itself

"""The pages' tables (sae_dist.analytics.tables) on plain dicts: what each cell reads, a value
not recorded as "—", progress as a fraction and times as datetimes for the page's columns."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

from sae_dist.analytics import tables

NOW = datetime(2026, 1, 2, 12, 0, tzinfo=timezone.utc)


def job(**changes) -> dict:
    base = {"id": 7, "name": "sae", "user": "ada", "gpus": 2, "devices": ["GPU-0123456789abcdef", "cpu"],
            "started_at": NOW - timedelta(seconds=185), "ended_at": None, "time_limit_s": 600,
            "cancel_requested": False, "priority": 0, "reason": "Priority",
            "submitted_at": NOW - timedelta(seconds=65), "state": "RUNNING", "exit_code": None, "signal": None}
    return {**base, **changes}


def test_running_rows_with_and_without_a_training_run():
    runs = {7: {"last_step": 150, "total_steps": 300}}
    with_run, bare = tables.running_rows([job(), job(id=8, time_limit_s=None, cancel_requested=True)], runs, NOW)
    assert with_run["Progress"] == 0.5 and with_run["Steps"] == "150 / 300"
    assert with_run["Elapsed"] == "3 min 05 s" and with_run["Time limit"] == "10 min 00 s"
    assert with_run["Devices"] == "GPU-01234567, cpu" and with_run["Note"] == ""
    assert bare["Progress"] is None and bare["Steps"] == "—" and bare["Time limit"] == "none"
    assert bare["Note"] == "cancelling" and isinstance(bare["Started"], datetime)
    over = tables.running_rows([job()], {7: {"last_step": 400, "total_steps": 300}}, NOW)[0]
    assert over["Progress"] == 1.0  # a run past its planned steps fills the bar, never more


def test_pending_and_finished_rows():
    (pending,) = tables.pending_rows([job(state="PENDING")], NOW)
    assert pending["Waiting"] == "1 min 05 s" and pending["Reason"].startswith("Priority")
    ended = NOW - timedelta(seconds=5)
    killed, ok = tables.finished_rows([job(state="CANCELLED", exit_code=None, signal=9, ended_at=ended),
                                       job(state="COMPLETED", exit_code=0, ended_at=ended, reason=None)], NOW)
    assert killed["Exit"] == "signal 9 (SIGKILL)" and killed["Elapsed"] == "3 min 00 s"
    assert ok["Exit"] == "0" and ok["Reason"] == "" and ok["Ended"] == ended


def test_cluster_rows_newest_first():
    old = SimpleNamespace(cluster_job_id=1, name="a", user="u", kind="train", state="COMPLETED",
                          exit_code=0, signal=None, started_at=None, ended_at=None)
    new = SimpleNamespace(**{**vars(old), "cluster_job_id": 2, "exit_code": None, "signal": 15})
    rows = tables.cluster_rows([old, new])
    assert [r["Job"] for r in rows] == ["slurm:2", "slurm:1"]
    assert [r["Exit"] for r in rows] == ["signal 15 (SIGTERM)", "0"]


def test_ranks_table_and_shares_table():
    ranks = [{"rank": 0, "device": None, "steps_logged": 3, "mean_step_time_s": 0.0149,
              "mean_compute_time_s": None, "peak_memory_bytes": 88 * 2**20, "straggler_steps": 1}]
    assert tables.ranks_table(ranks) == [{
        "Rank": 0, "Device": "—", "Steps logged": 3, "Mean step time": "14.9 ms",
        "Mean compute time": "—", "Peak memory": "88.0 MiB", "Straggler steps": 1}]
    window = [{"rank": 0, "device": "cpu:0", "batch_size": 384, "step_time_s": 0.05, "compute_time_s": 0.04},
              {"rank": 1, "device": "cpu:1", "batch_size": 128, "step_time_s": 0.05, "compute_time_s": 1.5}]
    shares = tables.shares_table(window)
    assert [r["Share"] for r in shares] == ["384 (75%)", "128 (25%)"]
    assert shares[1]["Compute time"] == "1.50 s"
    unknown = tables.shares_table([dict(window[0], batch_size=None), window[1]])
    assert [r["Share"] for r in unknown] == ["—", "128"]  # no partial total: no percentages


def test_columns_that_say_nothing_are_left_out():
    """No array task, no folded pending tasks, no note: those columns go, the others stay in
    their order; one row that speaks keeps its column."""
    plain = tables.pending_rows([job(state="PENDING"), job(id=8, state="PENDING")], NOW)
    assert list(plain[0])[-1] == "Reason"  # the one column of any length, last as in squeue
    assert list(tables.drop_quiet_columns(plain)[0]) == [
        "Job", "Name", "User", "GPUs", "Priority", "Waiting", "Submitted", "Reason"]
    folded = plain + [{**plain[0], "Task": "9_[0-3]", "Tasks": 4}]
    assert "Task" in tables.drop_quiet_columns(folded)[2] and "Tasks" in tables.drop_quiet_columns(folded)[0]
    expected = NOW + timedelta(minutes=3)  # the head's reservation: the column appears
    reserved = tables.drop_quiet_columns(tables.pending_rows([job(state="PENDING", expected_start_at=expected),
                                                              job(id=8, state="PENDING")], NOW))
    assert [r["Expected start"] for r in reserved] == [expected, None]
    running = tables.running_rows([job(), job(id=8, cancel_requested=True)], {}, NOW)
    assert "Note" in tables.drop_quiet_columns(running)[0]
    assert "Note" not in tables.drop_quiet_columns(running[:1])[0]
    assert tables.drop_quiet_columns([]) == []

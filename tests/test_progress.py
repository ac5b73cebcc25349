"""The Monitor's progress: the recent step rate, the ETA from it, the start-up status (plain data)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from sae_dist.analytics import progress

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


def points(steps_and_seconds):
    return [(step, T0 + timedelta(seconds=s)) for step, s in steps_and_seconds]


def test_the_rate_is_the_last_minute_of_logged_steps():
    # Slow start-up (10 steps in 100 s), then 10 steps a second: only the last minute counts.
    log = points([(10, 0), (20, 100)] + [(20 + 10 * i, 100 + i) for i in range(1, 121)])
    rate = progress.recent_rate(log)
    assert rate.steps_per_s == pytest.approx(10.0) and rate.seconds == pytest.approx(60.0)
    assert rate.steps == 600


def test_a_sparse_minute_falls_back_to_the_last_logged_steps():
    log = points([(100 * i, 30 * i) for i in range(1, 9)])  # a step logged every 30 s
    rate = progress.recent_rate(log)
    assert rate.steps == 100 * (progress.RATE_MIN_POINTS - 1)
    assert rate.steps_per_s == pytest.approx(100 / 30)


@pytest.mark.parametrize("log", [[], points([(10, 0)]), points([(10, 0), (10, 5)]), points([(10, 5), (20, 5)])])
def test_no_rate_without_two_distinct_logged_steps(log):
    assert progress.recent_rate(log) is None


def test_eta_is_the_remaining_steps_over_the_rate_and_unknown_without_one():
    rate = progress.Rate(steps_per_s=4.0, steps=40, seconds=10.0)
    assert progress.eta_s(200, 1000, rate) == pytest.approx(200.0)
    assert progress.eta_s(1000, 1000, None) == 0.0  # done: no rate needed
    assert progress.eta_s(200, 1000, None) is None
    assert progress.eta_s(200, 0, rate) is None and progress.eta_s(200, None, rate) is None


def job(**fields):
    return {"kind": "train", "state": "RUNNING", "gpus": 2, "started_at": T0, **fields}


def test_startup_without_a_run_is_starting_its_ranks():
    status = progress.startup_status(job(), None, has_steps=False, now=T0 + timedelta(seconds=12))
    assert status.title == "Starting 2 ranks" and "started 12 s ago" in status.detail
    one = progress.startup_status(job(gpus=1), None, has_steps=False, now=T0)
    assert one.title == "Starting 1 rank"


def test_startup_with_a_run_but_no_step_is_loading_and_first_steps():
    run = {"id": 7, "started_at": T0 + timedelta(seconds=20), "created_at": T0, "config": {"log_every": 10}}
    status = progress.startup_status(job(), run, has_steps=False, now=T0 + timedelta(seconds=35))
    assert status.title == "Building the SAEs / first steps"
    assert "Run 7 was recorded 15 s ago" in status.detail and "the first 10 steps" in status.detail


@pytest.mark.parametrize("fields, has_steps", [({}, True), ({"state": "COMPLETED"}, False),
                                                ({"kind": "command"}, False), ({"state": "PENDING"}, False)])
def test_no_startup_status_once_stepping_or_not_a_running_training(fields, has_steps):
    assert progress.startup_status(job(**fields), None, has_steps=has_steps, now=T0) is None

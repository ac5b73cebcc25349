"""The Monitor's series, bucketed by the database: real SQLite in a temporary state home.

Hand-made samples whose means, sums and maxima are known; NULL readings (a virtual device's
temperature and power) must come back None, never 0; the per-minute rows the trigger keeps
must give the same figures as the raw samples.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert, inspect, text

from sae_dist.analytics import jobs, samples
from sae_dist.db import GpuSample, RankStat, StepMetric, create_run, get_engine
from scheduler import actions
from scheduler.store import NewJob, finish_job, start_jobs, submit

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)  # a whole minute
GIB = 2**30


@pytest.fixture
def engine(state_home):
    return get_engine()


def add_samples(engine, rows: list[dict]) -> None:
    defaults = {"utilization_pct": None, "memory_used": None, "memory_total": None,
                "temperature_c": None, "power_w": None, "job_id": None}
    with engine.begin() as conn:
        conn.execute(insert(GpuSample.__table__), [{**defaults, **r} for r in rows])


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def steady(device: str, seconds: int, **fields) -> list[dict]:
    """One reading a second (at .3 s past it, as a sampler would) for `seconds` seconds."""
    return [{"device_uuid": device, "time": at(s + 0.3), **fields} for s in range(seconds)]


# ---- bucket widths ----------------------------------------------------------------------------

@pytest.mark.parametrize("span_s", [1, 59, 300, 3599, 3600, 86400, 7 * 86400, 400 * 86400])
@pytest.mark.parametrize("devices", [1, 8])
def test_bucket_width_keeps_any_window_within_the_budget(span_s, devices):
    width = samples.bucket_width(span_s, devices)
    # An aligned window touches at most ceil(span / width) + 1 buckets.
    assert math.ceil(span_s / width) + 1 <= samples.MAX_POINTS_PER_SERIES
    if span_s * devices > samples.RAW_ROW_BUDGET:
        assert width % 60 == 0  # read from the minute rows


def test_bucket_width_is_one_second_for_short_windows():
    assert samples.bucket_width(300) == 1
    assert samples.bucket_width(3600) == 2
    assert samples.bucket_width(86400, 8) == 60


@pytest.mark.slow
@pytest.mark.parametrize("budget", [10**9, 1], ids=["from samples", "from minutes"])
def test_series_never_exceed_max_points(engine, budget):
    add_samples(engine, steady("gpu-a", 3 * 3600, utilization_pct=50.0, memory_used=GIB))
    for max_points in (2000, 100):
        series = samples.device_series(engine, ["gpu-a"], T0, at(3 * 3600), max_points,
                                       raw_row_budget=budget)["gpu-a"]
        assert 0 < len(series) <= max_points
        # Whole minutes are read from the minute rows; the raw samples only when they are few.
        assert series.source == ("minutes" if series.width_s % 60 == 0 else "samples")
        assert series.source == "minutes" or budget > 1
        total = samples.total_series(engine, ["gpu-a"], T0, at(3 * 3600), max_points,
                                     raw_row_budget=budget)
        assert 0 < len(total) <= max_points
        assert set(series.columns["utilization_pct"]) == {50.0}
    # Bucket starts are whole multiples of the width: they do not move as a window slides.
    assert all(int(t.timestamp()) % series.width_s == 0 for t in series.columns["time"])


# ---- aggregates on hand-made samples -----------------------------------------------------------

@pytest.fixture
def two_devices(engine):
    """gpu-a: a real GPU; gpu-v: a virtual device without temperature or power sensors."""
    rows = []
    for s in range(10):  # two 5-second buckets: [0, 5) and [5, 10)
        rows.append({"device_uuid": "gpu-a", "time": at(s + 0.5), "utilization_pct": float(10 * s),
                     "memory_used": (s + 1) * GIB, "memory_total": 80 * GIB,
                     "temperature_c": 40.0 + s, "power_w": 100.0 + s})
        rows.append({"device_uuid": "gpu-v", "time": at(s + 0.5), "utilization_pct": 50.0,
                     "memory_used": 2 * GIB, "memory_total": 16 * GIB})
    add_samples(engine, rows)
    return engine


def test_device_series_means_and_maxima(two_devices):
    series = samples.device_series(two_devices, ["gpu-a", "gpu-v"], T0, at(10), max_points=3)
    a, v = series["gpu-a"], series["gpu-v"]
    assert a.width_s == 5 and a.source == "samples"
    assert a.columns["time"] == [T0, at(5)]
    assert a.columns["utilization_pct"] == pytest.approx([20.0, 70.0])  # mean of 0..40, 50..90
    assert a.columns["memory_used"] == pytest.approx([3 * GIB, 8 * GIB])
    assert a.columns["temperature_c"] == [44.0, 49.0]  # the bucket's hottest reading
    assert a.columns["power_w"] == pytest.approx([102.0, 107.0])
    assert v.columns["utilization_pct"] == pytest.approx([50.0, 50.0])
    # Not measured stays unknown: None, never 0.
    assert v.columns["temperature_c"] == [None, None]
    assert v.columns["power_w"] == [None, None]


def test_total_series_over_devices(two_devices):
    total = samples.total_series(two_devices, ["gpu-a", "gpu-v"], T0, at(10), max_points=3)
    c = total.columns
    assert c["time"] == [T0, at(5)]
    assert c["memory_used"] == pytest.approx([5 * GIB, 10 * GIB])  # 3 + 2, 8 + 2
    assert c["memory_total"] == [96 * GIB, 96 * GIB]
    assert c["utilization_pct"] == pytest.approx([35.0, 60.0])  # mean of the devices' means
    assert c["power_w"] == pytest.approx([102.0, 107.0])  # only gpu-a is measured...
    assert c["power_devices"] == [1, 1]  # ...and the total says so
    assert c["temperature_c"] == [44.0, 49.0]
    assert c["devices"] == [2, 2]


def test_unmeasured_totals_stay_none(engine):
    add_samples(engine, steady("virtual-0", 5, utilization_pct=20.0, memory_used=GIB,
                               memory_total=8 * GIB) +
                steady("virtual-1", 5, utilization_pct=40.0))  # memory not read either
    total = samples.total_series(engine, ["virtual-0", "virtual-1"], T0, at(5), max_points=10)
    c = total.columns
    assert c["power_w"] == [None] * 5 and c["power_devices"] == [0] * 5
    assert c["temperature_c"] == [None] * 5
    assert c["memory_used"] == [GIB] * 5 and c["memory_devices"] == [1] * 5
    assert c["memory_total"] == [8 * GIB] * 5  # only devices whose memory was read count
    assert c["utilization_pct"] == pytest.approx([30.0] * 5)


def test_minutes_give_the_same_figures_as_samples(engine):
    rows = []
    for s in range(600):
        rows.append({"device_uuid": "gpu-a", "time": at(s + 0.25), "utilization_pct": float(s % 7),
                     "memory_used": (s % 5) * GIB, "memory_total": 80 * GIB,
                     "temperature_c": 30.0 + s % 11, "power_w": None if s % 3 else float(s)})
        rows.append({"device_uuid": "gpu-b", "time": at(s + 0.75), "utilization_pct": None,
                     "memory_used": GIB, "memory_total": 40 * GIB})
    add_samples(engine, rows)
    devices = ["gpu-a", "gpu-b"]
    kwargs = dict(max_points=12)  # 600 s in buckets of 60 s
    raw = samples.device_series(engine, devices, T0, at(600), source="samples", **kwargs)
    rolled = samples.device_series(engine, devices, T0, at(600), source="minutes", **kwargs)
    for device in devices:
        assert raw[device].source == "samples" and rolled[device].source == "minutes"
        assert raw[device].width_s == rolled[device].width_s == 60
        assert rolled[device].columns["time"] == raw[device].columns["time"]
        for name in samples.DEVICE_FIELDS:
            assert rolled[device].columns[name] == pytest.approx(raw[device].columns[name]), name
    raw_total = samples.total_series(engine, devices, T0, at(600), source="samples", **kwargs)
    rolled_total = samples.total_series(engine, devices, T0, at(600), source="minutes", **kwargs)
    assert rolled_total.columns["time"] == raw_total.columns["time"]
    for name in samples.TOTAL_FIELDS:
        assert rolled_total.columns[name] == pytest.approx(raw_total.columns[name]), name
    assert raw["gpu-b"].columns["utilization_pct"] == [None] * 10


def test_the_minute_trigger_exists_at_head(engine):
    # A SQLite batch migration that recreates gpu_samples drops its triggers: this catches it.
    with engine.connect() as conn:
        names = conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).scalars()
        assert "gpu_samples_to_minutes" in set(names)
    assert "gpu_minutes" in inspect(engine).get_table_names()


# ---- a job's devices over its time span -------------------------------------------------------

def test_a_job_filter_keeps_its_devices_and_time_span(engine):
    for device in ("virtual-0", "virtual-1", "virtual-2"):
        add_samples(engine, steady(device, 120, utilization_pct=10.0))
    job_id = submit(engine, NewJob(name="j", kind="command", argv=["true"], gpus=2, workdir="/tmp"))
    start_jobs(engine, [(job_id, ("virtual-0", "virtual-1"))], {}, now=at(30))
    finish_job(engine, job_id, "COMPLETED", exit_code=0, now=at(90))
    job = jobs.get_job(engine, job_id)
    assert job["devices"] == ["virtual-0", "virtual-1"]

    series = samples.device_series(engine, job["devices"], job["started_at"], job["ended_at"])
    assert set(series) == {"virtual-0", "virtual-1"}  # not virtual-2
    for s in series.values():
        assert s.width_s == 1
        assert s.columns["time"][0] == at(30) and s.columns["time"][-1] == at(89)
        assert len(s) == 60
    latest = samples.latest_samples(engine, job["devices"], at=job["ended_at"])
    assert latest["virtual-0"]["time"] == at(89.3)  # its final state: the last reading in it
    assert samples.latest_samples(engine, ["virtual-0"], at=at(200), since=at(150)) == {
        "virtual-0": None}
    assert samples.first_sample_time(engine, ["virtual-1", "nowhere"]) == at(0.3)


def test_current_totals_from_latest_readings():
    latest = {
        "a": {"utilization_pct": 90.0, "memory_used": 10, "memory_total": 80,
              "temperature_c": 70.0, "power_w": 300.0},
        "b": {"utilization_pct": 10.0, "memory_used": 5, "memory_total": 80,
              "temperature_c": None, "power_w": None},
        "c": None,  # no reading
    }
    totals = samples.current_totals(latest)
    assert totals == {"utilization_pct": 50.0, "memory_used": 15, "memory_total": 160,
                      "temperature_c": 70.0, "power_w": 300.0, "power_devices": 1,
                      "memory_devices": 2, "devices": 2}
    assert samples.current_totals({"c": None})["power_w"] is None


# ---- training metrics by step -----------------------------------------------------------------

def make_run(engine, steps: range, ranks: int = 2) -> int:
    run_id = create_run(engine, name="r", status="RUNNING", architecture="topk", config_json="{}",
                        world_size=ranks, backend="gloo", device_ids='["cpu:0", "cpu:1"]',
                        host="h", run_dir="/tmp/r", total_steps=steps[-1])
    with engine.begin() as conn:  # straight in: the trainer's writer sheds rows under load
        conn.execute(insert(StepMetric.__table__), [
            {"run_id": run_id, "step": step, "samples_seen": step, "time": T0,
             "loss": float(step), "fvu": None} for step in steps])
        conn.execute(insert(RankStat.__table__), [
            {"run_id": run_id, "step": step, "rank": r, "device": f"cpu:{r}",
             "step_time_s": 0.01 * (r + 1), "compute_time_s": 0.01, "peak_memory_bytes": None,
             "is_straggler": r == 1 and step % 100 == 0} for step in steps for r in range(ranks)])
    return run_id


def test_run_curves_bucket_steps_with_mean_min_max(engine):
    run_id = make_run(engine, range(1, 5001))
    curves = samples.run_curves(engine, run_id, ("loss", "fvu"), max_points=100)
    assert len(curves["step"]) <= 100 and curves["width"] == 51
    assert curves["step"][0] == 50 and curves["step"][-1] == 5000  # each bucket's last step
    assert curves["loss"][1] == pytest.approx(sum(range(51, 102)) / 51)
    assert curves["loss_min"][1] == 51 and curves["loss_max"][1] == 101
    assert set(curves["fvu"]) == {None}  # never measured: a gap, not 0
    small = samples.run_curves(engine, run_id, ("loss",), max_points=10_000)
    assert small["width"] == 1 and small["loss"] == [float(s) for s in range(1, 5001)]


def test_rank_times_count_stragglers(engine):
    run_id = make_run(engine, range(1, 1001))
    times = samples.rank_times(engine, run_id, "step_time_s", max_rows=200)
    assert len(times["step"]) <= 200
    assert set(times["rank"]) == {0, 1} and times["device"][0] == "cpu:0"
    assert sum(times["stragglers"]) == 10  # rank 1 at every 100th step
    assert all(s == 0 for r, s in zip(times["rank"], times["stragglers"]) if r == 0)
    assert set(round(v, 6) for r, v in zip(times["rank"], times["mean_s"]) if r == 1) == {0.02}
    assert samples.rank_times(engine, 999)["step"] == []


# ---- the queue's helpers ----------------------------------------------------------------------

def test_tail_lines_reads_only_the_end(tmp_path):
    log = tmp_path / "job.out"
    log.write_text("".join(f"line {i}\n" for i in range(10_000)))
    assert jobs.tail_lines(log, 3) == ["line 9997", "line 9998", "line 9999"]
    tail = jobs.tail_lines(log, 10_000, max_bytes=1000)
    assert tail[-1] == "line 9999" and all(t.startswith("line ") for t in tail)
    assert len(tail) < 200  # only the last kilobyte was read, its first (cut) line dropped
    assert jobs.tail_lines(tmp_path / "missing.out") is None


def test_available_actions_follow_the_state():
    ok = actions.available("PENDING", held=False)
    assert ok["cancel"] is None and ok["hold"] is None and ok["release"] and ok["requeue"]
    held = actions.available("PENDING", held=True)
    assert held["release"] is None and held["hold"]
    running = actions.available("RUNNING", held=False)
    assert running["cancel"] is None and running["requeue"] is None and running["hold"]
    assert actions.available("RUNNING", False, cancel_requested=True)["cancel"]
    assert actions.available("RUNNING", False, cancel_requested=True)["requeue"]
    done = actions.available("COMPLETED", held=False)
    assert done["requeue"] is None and done["cancel"] and done["release"]
    cancelled = actions.available("CANCELLED", held=False, cancel_requested=True)
    assert cancelled["requeue"] is None  # the flag of its cancellation stays; requeue clears it


def test_explain_reason():
    assert jobs.explain_reason("Resources").startswith("Resources: waiting for enough free")
    assert jobs.explain_reason("Requeued after FAILED") == "Requeued after FAILED"
    assert jobs.explain_reason("Resources, RunningJobs:3,5") == (
        "Resources, RunningJobs:3,5: it runs alone (exclusive) and waits for jobs 3, 5 to end")
    assert jobs.explain_reason("Resources, ExclusiveJob:12") == (
        "Resources, ExclusiveJob:12: exclusive job 12 holds the whole machine")

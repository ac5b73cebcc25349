"""The app's logic without Streamlit: queries on a real SQLite state database, downsampling,
formatting, and chart specs (each under Altair's 5,000-row limit)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from sae_dist import format as fmt
from sae_dist.analytics import charts, queries, samples, tables
from sae_dist.analytics.downsample import (
    MAX_ROWS_PER_CHART,
    downsample,
    downsample_indices,
    points_per_series,
)
from sae_dist.db import DatabaseMetricsLogger, create_run, get_engine

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


def make_run(engine, *, name="run", status="RUNNING", total_steps=100, world_size=2, **fields):
    return create_run(engine, name=name, status=status, architecture="topk",
                      config_json=json.dumps({"architecture": "topk", "k": 4, "steps": total_steps}),
                      world_size=world_size, backend="gloo",
                      device_ids=json.dumps([f"cpu:{r}" for r in range(world_size)]),
                      host="testhost", run_dir=f"/tmp/runs/{name}", total_steps=total_steps,
                      started_at=T0, created_at=T0, **fields)


def log_steps(engine, run_id, steps, *, world_size=2, straggler_every=0, memory=True, **metric_fns):
    """Write steps through the trainer's own writer; metric_fns: name -> f(step) (None: missing)."""
    steps = list(steps)
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01, max_pending=100_000) as writer:
        for step in steps:  # all metrics, then all rank rows: few, large statements
            metrics = {"samples_seen": 256 * step, "time": T0 + timedelta(seconds=step)}
            metrics |= {name: f(step) for name, f in metric_fns.items()}
            writer.log(metrics, step)
        for step in steps:
            flagged = bool(straggler_every and step % straggler_every == 0)
            writer.log_rank_stats(step, [
                {"rank": r, "device": f"cpu:{r}", "step_time_s": 0.01 + 0.001 * r,
                 "compute_time_s": 0.005 + (0.02 if flagged and r == 1 else 0.0),
                 "peak_memory_bytes": (100 + r) * 2**20 if memory else None,
                 "is_straggler": flagged and r == 1}
                for r in range(world_size)])
        writer.update_run(last_step=steps[-1])

def rows_in(chart) -> int:
    """Rows an Altair chart carries (to_dict() itself refuses more than 5,000 per dataset)."""
    spec = chart.to_dict()
    return sum(len(values) for values in spec.get("datasets", {}).values())


@pytest.fixture
def engine(state_home):
    return get_engine()


# ---- downsampling: pure ----

def test_short_series_kept_whole_and_missing_values_dropped():
    assert downsample([1, 2, 3], [0.5, None, float("nan")]) == ([1], [0.5])
    assert downsample_indices([3.0, 1.0, 2.0]) == [0, 1, 2]


def test_minmax_keeps_spikes_first_last_and_budget():
    n = 100_000
    values = [math.sin(i / 500) for i in range(n)]
    values[54_321] = 50.0  # a loss spike must survive
    values[77_777] = -50.0
    steps, kept = downsample(list(range(n)), values, max_points=2_000)
    assert len(steps) <= 2_000
    assert steps[0] == 0 and steps[-1] == n - 1
    assert 54_321 in steps and 77_777 in steps
    assert steps == sorted(steps)
    assert all(values[s] == v for s, v in zip(steps, kept))  # real points only, at real steps


def test_last_mode_and_bad_arguments():
    idx = downsample_indices(list(range(10_000)), max_points=100, keep="last")
    assert len(idx) <= 100 and idx[0] == 0 and idx[-1] == 9_999
    with pytest.raises(ValueError):
        downsample_indices([1.0], max_points=2)
    with pytest.raises(ValueError):
        downsample([1, 2], [1.0])
    assert points_per_series(8) * 8 <= MAX_ROWS_PER_CHART
    assert points_per_series(1) == 2_000


# ---- formatting: missing is "—", never 0 ----

def test_formatting_of_missing_and_present_values():
    assert fmt.fmt_number(None) == fmt.fmt_percent(None) == fmt.fmt_bytes(None) == "—"
    assert fmt.fmt_number(float("nan")) == fmt.fmt_seconds(None) == fmt.fmt_ago(None) == "—"
    assert fmt.fmt_number(0.0) == "0"
    assert fmt.fmt_number(0.570484) == "0.5705"
    assert fmt.fmt_number(32656.6, 3) == "32,657"
    assert fmt.fmt_bytes(88 * 2**20) == "88.0 MiB"
    assert fmt.fmt_seconds(0.0149) == "14.9 ms"
    assert fmt.fmt_steps(150, 300) == "150 / 300"


# ---- queries on a real database ----

def test_empty_database(engine):
    assert queries.list_runs(engine) == []
    assert queries.get_run_summary(engine, 1) is None
    assert queries.run_step_metrics(engine, 1) == {m: [] for m in ("step", *queries.CURVE_METRICS)}
    assert queries.rank_summary(engine, 1) == []


def test_runs_summaries_latest_and_final_metrics(engine):
    done = make_run(engine, name="done", status="COMPLETED", total_steps=40)
    log_steps(engine, done, range(10, 41, 10), fvu=lambda s: 1.0 / s, l0=lambda s: 4.0,
              loss=lambda s: 2.0 / s, dead_fraction=lambda s: 0.0,
              samples_per_s=lambda s: None if s == 10 else 1000.0 + s)
    from sae_dist.db import update_run
    update_run(engine, done, final_fvu=0.025, final_l0=4.0, final_loss=0.05,
               final_dead_fraction=0.0, final_samples_per_s=1040.0, finished_at=T0 + timedelta(minutes=1))
    live = make_run(engine, name="live", total_steps=100)
    log_steps(engine, live, [5, 10], fvu=lambda s: 0.9, l0=lambda s: None)
    empty = make_run(engine, name="fresh", total_steps=0)

    runs = queries.list_runs(engine)
    assert [r["id"] for r in runs] == [empty, live, done]  # newest first
    fresh, running, finished = runs
    assert finished["status"] == "COMPLETED" and finished["final"]
    assert finished["fvu"] == 0.025 and finished["progress"] == 1.0
    assert finished["devices"] == ["cpu:0", "cpu:1"]
    assert running["last_step"] == 10 and running["progress"] == 0.1 and not running["final"]
    assert running["fvu"] == 0.9  # the latest logged value
    assert running["l0"] is None and running["samples_per_s"] is None  # not measured: None, not 0
    assert running["last_update"] == T0 + timedelta(seconds=10)
    assert fresh["progress"] is None and fresh["fvu"] is None and fresh["last_update"] is None
    assert "config" not in running

    detail = queries.get_run_summary(engine, live)
    assert detail["config"]["k"] == 4 and detail["name"] == "live"

    table = tables.runs_table(runs, T0 + timedelta(seconds=70))
    assert table[1]["steps"] == "10 / 100" and table[1]["L0"] == "—" and table[1]["FVU"] == "0.9"
    assert table[1]["last update"] == "60 s ago"
    assert table[0]["FVU"] == "—" and table[0]["last update"] == "—"


def test_step_metrics_and_rank_stats(engine):
    run = make_run(engine, total_steps=30)
    log_steps(engine, run, [10, 20, 30], straggler_every=20, fvu=lambda s: 1.0 / s,
              loss=lambda s: float("nan") if s == 20 else 1.0)
    metrics = queries.run_step_metrics(engine, run)
    assert metrics["step"] == [10, 20, 30]
    assert metrics["fvu"] == pytest.approx([0.1, 0.05, 1 / 30])
    assert metrics["loss"] == [1.0, None, 1.0]  # NaN is stored as NULL: shown as missing
    assert metrics["l0"] == [None, None, None]
    with pytest.raises(ValueError):
        queries.run_step_metrics(engine, run, ("fvu", "nonsense"))

    stats = queries.run_rank_stats(engine, run)
    assert stats["step"] == [10, 10, 20, 20, 30, 30] and stats["rank"] == [0, 1] * 3
    assert stats["is_straggler"] == [False, False, False, True, False, False]

    ranks = queries.rank_summary(engine, run)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[1]["device"] == "cpu:1" and ranks[1]["steps_logged"] == 3
    assert ranks[1]["straggler_steps"] == 1 and ranks[0]["straggler_steps"] == 0
    assert ranks[1]["peak_memory_bytes"] == 101 * 2**20
    assert ranks[0]["mean_step_time_s"] == pytest.approx(0.01)


# ---- charts: specs from real data, under the row limit ----

@pytest.mark.slow
def test_charts_of_a_long_run_stay_under_the_row_limit(engine):
    run = make_run(engine, total_steps=6_000, world_size=4)
    log_steps(engine, run, range(1, 6_001), world_size=4, straggler_every=7,
              fvu=lambda s: 1.0 / math.sqrt(s), l0=lambda s: 4.0 + (s % 3),
              loss=lambda s: 1.0 / s, dead_fraction=lambda s: 0.0)
    metrics = queries.run_step_metrics(engine, run)
    assert len(metrics["step"]) == 6_000
    for metric in queries.CURVE_METRICS:
        chart = charts.training_curve(metrics, metric)
        assert 0 < rows_in(chart) <= 2_000
        assert chart.to_dict()["title"] == charts.METRIC_LABELS[metric]

    stats = queries.run_rank_stats(engine, run)
    assert len(stats["step"]) == 24_000
    for field in ("step_time_s", "compute_time_s"):  # bucketed by the database, as both pages draw it
        times = samples.rank_times(engine, run, field, max_rows=charts.RANK_LINE_ROWS)
        assert 0 < rows_in(charts.binned_rank_time_chart(times, field)) <= MAX_ROWS_PER_CHART
    layered = charts.binned_rank_time_chart(samples.rank_times(engine, run)).to_dict()
    stragglers = [d for d in layered["datasets"].values() if d and all(row["rank"] == "1 (cpu:1)" for row in d)]
    assert stragglers, "the straggler marks are a layer of rank 1's flagged buckets"

    memory = charts.peak_memory_chart(queries.rank_summary(engine, run))
    assert rows_in(memory) == 4
    spec = memory.to_dict()  # each bar under its rank's number; the device in its tooltip
    assert spec["encoding"]["x"]["field"] == "number" and "rank" in [t["field"] for t in spec["encoding"]["tooltip"]]
    with pytest.raises(ValueError, match="step_time_s or compute_time_s"):
        samples.rank_times(engine, run, "nonsense")


def test_charts_draw_nothing_that_was_not_measured(engine):
    run = make_run(engine, total_steps=10)
    log_steps(engine, run, [1, 2], memory=False, fvu=lambda s: 0.5)
    metrics = queries.run_step_metrics(engine, run)
    assert charts.training_curve(metrics, "l0") is None  # never logged: no flat zero line
    assert rows_in(charts.training_curve(metrics, "fvu")) == 2
    assert charts.peak_memory_chart(queries.rank_summary(engine, run)) is None
    assert charts.binned_rank_time_chart(samples.rank_times(engine, 999)) is None


@pytest.mark.slow
def test_analytics_imports_neither_streamlit_nor_scheduler():
    code = ("import sys; import sae_dist.analytics.queries, sae_dist.analytics.charts, "
            "sae_dist.analytics.downsample, sae_dist.format, "
            "sae_dist.analytics.cards, sae_dist.analytics.events, sae_dist.analytics.units; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('streamlit', 'scheduler')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)

"""Every metric card on the Monitor and Training runs pages reads its chart's last point.

A real state database in a temporary home is filled through the trainer's own writer: a
run whose feature recovery is written at checkpoints only (as the trainer does), so the last
logged step has none, and whose throughput is missing at its last step. The pages are opened
with AppTest (from app.py, then switch_page); for each card, the chart beside it is found in
the page by title (`chart_views`: a view may stack several charts), its plotted rows are read
back from the element (the Arrow data Streamlit sends the browser) and the card must equal the
last non-null value there, written with the chart's own tooltip format. No exception after any
run.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import insert
from streamlit.testing.v1 import AppTest

from chart_views import page_charts
from conftest import REPO, add_virtual_devices
from sae_dist.analytics import charts, units
from sae_dist.analytics.cards import TRAINING_CARDS
from sae_dist.db import DatabaseMetricsLogger, GpuSample, add_run_event, create_run, get_engine, update_run, utcnow
from sae_dist.format import MISSING, fmt_d3
from scheduler.store import NewJob, start_jobs, submit

MONITOR = "pages/2_Monitor.py"
RUNS = "pages/4_Training_runs.py"
TIMEOUT = 30  # the first run imports pandas and Altair
GIB = 2**30
DEVICES = ["virtual-0", "virtual-1"]
CHECKPOINTS = (100, 200)  # recovery is measured here only: never at the last step, 300
EVENTS = 46


@pytest.fixture(autouse=True)
def environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.delenv("SAE_DIST_MONITOR_VIEW", raising=False)


@pytest.fixture
def training(state_home):
    """A running training job on two virtual devices sampled for 5 minutes, its run logged
    every 10 steps to step 300 with recovery at the checkpoints only, 46 rebalances."""
    engine = get_engine()
    now = utcnow()
    with engine.begin() as conn:
        add_virtual_devices(conn, DEVICES, now)
        conn.execute(insert(GpuSample.__table__), [
            {"device_uuid": u, "time": now - timedelta(seconds=300 - s),
             "utilization_pct": 30.0 + 10 * i + (s % 7), "memory_used": (i + 1) * GIB + s * 2**20,
             "memory_total": 16 * GIB, "temperature_c": None, "power_w": None, "job_id": None}
            for s in range(300) for i, u in enumerate(DEVICES)])
    job = submit(engine, NewJob(name="trainer", kind="train", argv=["train"], gpus=2, workdir="/tmp"))
    start_jobs(engine, [(job, tuple(DEVICES))], {}, now=now - timedelta(seconds=300))
    start = now - timedelta(seconds=300)
    run_id = create_run(engine, name="cards-run", status="RUNNING", architecture="topk",
                        config_json=json.dumps({"source": "synthetic"}), world_size=2,
                        backend="gloo", device_ids=json.dumps(DEVICES), host="test",
                        run_dir="/tmp/cards-run", total_steps=1000, job_id=job,
                        started_at=start, created_at=start)
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as writer:
        for step in range(10, 310, 10):
            checkpoint = step in CHECKPOINTS
            writer.log({"samples_seen": 64 * step, "loss": 1.0 / step, "fvu": 0.5 / step,
                        "l0": 8.0 - step / 1000, "dead_fraction": step / 30_000,
                        "samples_per_s": 400.0 + step if step < 300 else None,
                        "recovery_frac": step / 800 if checkpoint else None,
                        "recovery_mean_cos": 0.5 + step / 1000 if checkpoint else None}, step)
            writer.log_rank_stats(step, [
                {"rank": r, "device": DEVICES[r], "step_time_s": 0.02 + 0.01 * r,
                 "compute_time_s": 0.01, "peak_memory_bytes": (r + 1) * 2**20,
                 "is_straggler": r == 1} for r in (0, 1)])
        writer.update_run(last_step=300)
    for i in range(EVENTS):
        add_run_event(engine, run_id, 5 + 6 * i, "rebalance", f"rebalanced #{i}",
                      {"before": [128, 128], "after": [192, 64]})
    return {"engine": engine, "job": job, "run": run_id}


def open_page(page: str, **query) -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT).run()
    assert not at.exception, at.exception
    for key, value in query.items():
        at.query_params[key] = value
    at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


# ---- reading the charts back from the page -------------------------------------------------------

def chart_data(at: AppTest) -> dict[str, list[tuple[dict, object]]]:
    """Each chart on the page by title: its layers (the spec's) with the rows they plot."""
    return {chart.title: chart.layers for chart in page_charts(at)}


def chart_data_in_order(at: AppTest) -> list[tuple[str | None, list[tuple[dict, object]]]]:
    """Every chart on the page in page order: (title, its layers with their rows)."""
    return [(chart.title, chart.layers) for chart in page_charts(at)]


def last_point_text(layers, field: str = "value", suffix: str = "") -> str:
    """The chart's last non-null `field` value in its line layer, written with the format of
    the line's tooltip for that field: what the card beside the chart must read."""
    layer, frame = next((layer, frame) for layer, frame in layers
                        if layer["mark"]["type"] == "line"
                        and layer["encoding"]["y"]["field"] == field)
    tooltip = next(t for t in layer["encoding"]["tooltip"] if t["field"] == field)
    values = frame[field].dropna()
    return fmt_d3(float(values.iloc[-1]), tooltip["format"]) + suffix if len(values) else MISSING


def cards(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def assert_training_cards_match(at: AppTest) -> int:
    """Every "Latest <metric>" card equals its chart's last plotted value; how many."""
    plotted = chart_data(at)
    labels = {f"Latest {name}": metric for metric, name in TRAINING_CARDS.items()}
    checked = 0
    for label, value in cards(at).items():
        if label not in labels:
            continue
        title = units.TRAINING[labels[label]].title
        assert title in plotted, f"{label}: no chart {title!r} beside it"
        assert value == last_point_text(plotted[title]), label
        checked += 1
    return checked


# ---- the pages -----------------------------------------------------------------------------------

@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_cards_are_their_charts_last_points(training):
    at = open_page(MONITOR, job=str(training["job"]))
    shown = cards(at)
    # The reported bug: the last row has no recovery, the chart plots step 200's.
    assert shown["Latest features recovered"] == "25.0%"  # 200 / 800
    assert shown["Latest mean best cosine"] == "0.700"
    assert shown["Latest samples/s"] == "690"  # step 290's: step 300 logged none
    assert shown["Latest FVU"] == "0.001667" and shown["Latest loss"] == "0.003333"
    assert assert_training_cards_match(at) == 7

    plotted = chart_data(at)  # the device cards: the aggregated charts' last points
    memory = plotted[charts.TOTAL_TITLES["memory_used"]]
    assert shown["Memory used"] == (last_point_text(memory) + " GiB of "
                                    + last_point_text(memory, "total") + " GiB")
    assert shown["Mean utilisation"] == last_point_text(
        plotted[charts.TOTAL_TITLES["utilization_pct"]], suffix="%")
    assert shown["Total power"] == MISSING and shown["Hottest"] == MISSING  # no chart: no point
    assert charts.TOTAL_TITLES["power_w"] not in plotted

    at.segmented_control(key="monitor_view").set_value("Per-GPU").run()
    assert not at.exception
    # Each device figure sits above its sparkline (a chart with a time axis, no title), in page
    # order; a figure nothing measured (a virtual device's temperature and power) has none.
    sparklines = [layers for title, layers in chart_data_in_order(at) if title is None]
    measured = [m for m in at.metric if m.label in ("Memory", "Utilisation")]
    assert len(measured) == len(sparklines) == 4  # 2 devices x memory and utilisation
    for metric, layers in zip(measured, sparklines):
        (layer, frame), = layers
        tooltip = next(t for t in layer["encoding"]["tooltip"] if t["field"] == "value")
        values = frame["value"].dropna()
        suffix = {"Memory": " GiB", "Utilisation": "%"}[metric.label]
        assert metric.value == fmt_d3(float(values.iloc[-1]), tooltip["format"]) + suffix, metric.label
    assert {m.value for m in at.metric if m.label in ("Temperature", "Power")} == {MISSING}
    assert assert_training_cards_match(at) == 7


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_run_events_are_opt_in_and_grouped(training):
    at = open_page(MONITOR, job=str(training["job"]))
    toggle = at.toggle(key="monitor_show_events")
    assert toggle.value is False and not toggle.disabled
    assert not [layer for layers in chart_data(at).values() for layer, _ in layers
                if layer["mark"]["type"] == "rule"]  # off by default: the curves come bare
    toggle.set_value(True).run()
    assert not at.exception
    plotted = chart_data(at)
    marks = {title: frame for title, layers in plotted.items() for layer, frame in layers
             if layer["mark"]["type"] == "rule"}
    assert set(marks) >= {units.TRAINING[m].title for m in ("loss", "fvu", "l0")}
    for title, frame in marks.items():
        assert len(frame) <= 20, title  # 46 events, never more than 20 marks
        assert frame["count"].sum() == EVENTS, title
    assert assert_training_cards_match(at) == 7  # the marks change no card
    at.toggle(key="monitor_show_events").set_value(False).run()
    assert not at.exception


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_training_runs_cards_are_their_charts_last_points(training):
    at = open_page(RUNS, run=str(training["run"]))
    shown = cards(at)
    assert shown["Latest features recovered"] == "25.0%"
    assert shown["Latest samples/s"] == "690"
    assert assert_training_cards_match(at) == 7

    toggle = at.toggle(key="runs_show_events")
    assert toggle.value is False and not toggle.disabled
    toggle.set_value(True).run()
    assert not at.exception
    rules = [frame for layers in chart_data(at).values() for layer, frame in layers
             if layer["mark"]["type"] == "rule"]
    assert rules and all(len(f) <= 20 and f["count"].sum() == EVENTS for f in rules)
    assert assert_training_cards_match(at) == 7


def test_a_finished_run_shows_final_cards_from_its_charts(training):
    engine, run_id = training["engine"], training["run"]
    update_run(engine, run_id, status="COMPLETED", finished_at=utcnow(), final_fvu=0.5 / 300,
               final_loss=1.0 / 300, final_l0=7.7, final_dead_fraction=0.01, final_samples_per_s=None,
               recovery_frac=None, recovery_mean_cos=None)
    at = open_page(RUNS, run=str(run_id))
    shown = cards(at)
    assert shown["Final FVU"] == "0.001667" and shown["Final features recovered"] == "25.0%"
    plotted = chart_data(at)
    for metric, name in TRAINING_CARDS.items():
        assert shown[f"Final {name}"] == last_point_text(plotted[units.TRAINING[metric].title])


def test_a_run_without_steps_shows_dashes(state_home):
    engine = get_engine()
    create_run(engine, name="empty-run", status="RUNNING", architecture="topk",
               config_json="{}", world_size=1, backend="gloo", device_ids='["cpu:0"]',
               host="test", run_dir="/tmp/empty-run", total_steps=100)
    at = open_page(RUNS)
    shown = cards(at)
    assert all(shown[f"Latest {name}"] == MISSING
               for name in ("loss", "FVU", "L0", "dead latents", "samples/s"))
    assert "Latest features recovered" not in shown  # no recovery: no section
    assert at.toggle(key="runs_show_events").disabled

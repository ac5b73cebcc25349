"""Cards agree with their charts, axes read sensibly, run events stay few: pure, plain data.

A card's text comes from the data frame its chart plots (`charts.Panel`), formatted with the
chart's own tooltip format (`format.fmt_d3` writes numbers as d3-format does); the charts'
axes take their formats from `units`; dense run events are grouped into at most 20 marks.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest

from sae_dist.analytics import cards, charts, units
from sae_dist.analytics.events import events_summary, group_events, kinds_text
from sae_dist.format import MISSING, fmt_d3

# ---- numbers as d3-format writes them ----------------------------------------------------------

@pytest.mark.parametrize("value, spec, text", [
    (0.25, ".1%", "25.0%"), (0.25, "~%", "25%"), (0.0125, ".3~%", "1.25%"),
    (1 / 600, ".4~g", "0.001667"), (200.0, "~g", "200"), (200.0, ".3~g", "200"),
    (4.0, ".3~g", "4"), (3.9998, ".4~g", "4"), (0.0, ".4~g", "0"),
    (1.5e-7, ".4~g", "1.5e-7"), (0.00001234, ".4g", "0.00001234"), (12345.0, ".4~g", "1.235e+4"),
    (9.9996, ".4g", "10.00"), (1000.0, ",.0f", "1,000"), (12345.6, ",.0f", "12,346"),
    (2.5, "d", "3"), (1234567, ",d", "1,234,567"), (0.5, ".0f", "1"),  # ties away from zero
    (3.0, ".1f", "3.0"), (0.0003, ".2e", "3.00e-4"), (-0.5, ".1f", "\u22120.5"),
    (-0.0001, ".1f", "0.0"),  # a negative that rounds to zero loses its sign, as in d3
    (-2.5, "d", "\u22122"),  # Math.round: ties towards +infinity
    (0.145, ".1%", "14.5%"),  # multiplied by 100 in floating point first, as d3 does
])
def test_fmt_d3_writes_numbers_as_the_chart_does(value, spec, text):
    assert fmt_d3(value, spec) == text


def test_fmt_d3_missing_and_unsupported():
    assert fmt_d3(None, ".1%") == MISSING and fmt_d3(float("nan"), ".4~g") == MISSING
    with pytest.raises(ValueError):
        fmt_d3(1.0, "$,.2s")


# ---- a card is its chart's last plotted value ----------------------------------------------------

def test_last_plotted_skips_what_the_chart_does_not_draw():
    frame = pd.DataFrame({"step": [100, 200, 300],
                          "value": pd.array([0.1, 0.25, None], dtype="Float64")})
    assert cards.last_plotted(frame) == 0.25
    assert cards.last_plotted_row(frame) == {"step": 200, "value": 0.25}
    assert cards.card_text(frame, units.TRAINING["recovery_frac"]) == "25.0%"
    empty = pd.DataFrame({"step": [], "value": []})
    assert cards.last_plotted(empty) is None and cards.last_plotted(None) is None
    assert cards.card_text(empty, units.TRAINING["loss"]) == MISSING
    assert cards.last_present([1.0, None, float("nan")]) == (0, 1.0)
    assert cards.last_present([None]) == (None, None)


def test_recovery_card_reads_the_checkpoint_the_chart_plots():
    """The reported bug: recovery is written at checkpoints only, so the latest row has none;
    the card said "—" beside a chart at 25 %."""
    steps = list(range(10, 301, 10))
    recovery = [0.25 if s == 200 else (0.1 if s == 100 else None) for s in steps]
    curves = {"width": 1, "step": steps, "recovery_frac": recovery,
              "recovery_frac_min": recovery, "recovery_frac_max": recovery}
    panel = charts.binned_panel(curves, "recovery_frac")
    assert panel.text == "25.0%"
    assert panel.card("Latest features recovered") == cards.Card(
        "Latest features recovered", "25.0%", "The chart's last point: step 200.")
    spec = panel.chart.to_dict()
    plotted = [row for data in spec["datasets"].values() for row in data]
    assert [row["step"] for row in plotted] == [100, 200]
    assert spec["encoding"]["tooltip"][1]["format"] == ".1%"  # the card's format
    assert spec["encoding"]["y"]["axis"]["format"] == "~%"  # ticks: 25%, never 0.250000

    metrics = {"step": steps, "recovery_frac": recovery}
    assert charts.training_panel(metrics, "recovery_frac").text == "25.0%"
    assert charts.training_panel({"step": [], "recovery_frac": []}, "recovery_frac").text == MISSING
    assert charts.training_panel({"step": [], "recovery_frac": []}, "recovery_frac").chart is None


def test_a_bucketed_card_is_the_last_bucket_mean():
    curves = {"width": 50, "step": [49, 99, 120], "loss": [2.0, 1.0, 0.123456],
              "loss_min": [1.5, 0.9, 0.1], "loss_max": [2.5, 1.1, 0.15]}
    panel = charts.binned_panel(curves, "loss")
    assert panel.text == "0.1235"  # ".4~g", the tooltip's format
    assert "mean of the logged steps in its bucket of 50 steps, up to step 120" in panel.help
    final = cards.training_cards({"loss": panel}, final=True)
    assert final == [cards.Card("Final loss", "0.1235", panel.help)]
    assert cards.training_cards({"loss": panel}, final=False)[0].label == "Latest loss"


def test_training_panel_card_follows_downsampling():
    steps = list(range(1, 10_001))
    values = [1.0 / s for s in steps[:-3]] + [None, None, None]
    panel = charts.training_panel({"step": steps, "fvu": values}, "fvu", max_points=100)
    assert len(panel.frame) <= 100
    assert int(panel.frame["step"].iloc[-1]) == 9_997
    assert panel.text == fmt_d3(1 / 9_997, ".4~g") == "0.0001"
    assert panel.help == "The chart's last point: step 9,997."


def _times(n: int) -> list[datetime]:
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return [start + timedelta(seconds=i) for i in range(n)]


def test_device_cards_are_the_charts_last_points():
    gib = 2**30
    columns = {"time": _times(4), "memory_used": [gib, 2 * gib, 3 * gib, None],
               "memory_total": [32 * gib] * 4, "utilization_pct": [10.0, 20.0, 37.4, 36.6],
               "power_w": [None] * 4, "temperature_c": [50.0, 61.0, None, None],
               "devices": [2, 2, 2, 2], "memory_devices": [2, 2, 2, 0], "power_devices": [0] * 4}
    panels = {f: charts.device_panel(columns, f, 1, total=True) for f in charts.DEVICE_PANELS}
    assert panels["memory_used"].text == "3.0 GiB of 32.0 GiB"
    assert cards.last_plotted_row(panels["memory_used"].frame)["memory_devices"] == 2
    assert panels["utilization_pct"].text == "37%"
    assert panels["temperature_c"].text == "61 °C"
    assert panels["power_w"].text == MISSING and panels["power_w"].chart is None
    assert cards.sparkline_text(columns["memory_used"], units.DEVICE["memory_used"]) == "3.0 GiB"
    assert cards.sparkline(columns["memory_used"], 1 / gib) == [1.0, 2.0, 3.0]
    assert cards.sparkline([None, None]) is None
    assert cards.sparkline_text([None], units.DEVICE["power_w"]) == MISSING


# ---- axes --------------------------------------------------------------------------------------

def _axes(spec: dict) -> dict[str, str | None]:
    """Each positional encoding's field -> its axis format, over every layer."""
    found = {}
    for part in [spec, *spec.get("layer", [])]:
        for channel in ("x", "y"):
            encoding = part.get("encoding", {}).get(channel)
            if encoding and "field" in encoding:
                found[f"{channel}:{encoding['field']}"] = (encoding.get("axis") or {}).get("format")
    return found


@pytest.mark.parametrize("metric, axis", [
    ("loss", "~r"), ("fvu", "~r"), ("l0", "~r"), ("dead_fraction", "~%"),
    ("samples_per_s", ",~r"), ("recovery_frac", "~%"), ("recovery_mean_cos", "~r"),
])
def test_training_axes_have_a_format_per_metric(metric, axis):
    steps = [100, 200, 300]
    values = {"loss": [0.5, 0.4, 0.3], "fvu": [0.5, 0.4, 0.3], "l0": [3.9998, 4.0, 4.0],
              "dead_fraction": [0.0, 0.01, 0.02], "samples_per_s": [1000.0, 1001.0, 999.0],
              "recovery_frac": [0.0, 0.25, 0.5], "recovery_mean_cos": [0.5, 0.8, 0.9]}[metric]
    curves = {"width": 2, "step": steps, metric: values,
              f"{metric}_min": [v * 0.9 for v in values], f"{metric}_max": [v * 1.1 for v in values]}
    for chart in (charts.training_curve({"step": steps, metric: values}, metric),
                  charts.binned_curve(curves, metric)):
        found = _axes(chart.to_dict())
        assert found["x:step"] == ",d"  # whole steps: "12,000", never "12000.000000"
        assert found["y:value"] == axis
        assert all(fmt for fmt in found.values())  # no axis left to Vega's default


def test_axis_formats_leave_the_precision_to_the_tick_step():
    """A fixed precision on an axis writes "200.000000" or "1e+2"; a type alone lets Vega
    work out the digits the ticks need (and "r" never turns exponential)."""
    table = [*units.TRAINING.values(), *units.DEVICE.values(), units.RANK_TIME, units.PEAK_MEMORY]
    assert all(re.fullmatch(r",?~[r%e]", unit.axis) for unit in table), \
        [unit.axis for unit in table if not re.fullmatch(r",?~[r%e]", unit.axis)]
    assert units.STEP_AXIS_FORMAT == ",d"


def test_rank_memory_and_device_axes():
    times = {"width": 1, "step": [10, 10], "rank": [0, 1], "device": ["cpu:0", "cpu:1"],
             "mean_s": [0.01, 0.02], "max_s": [0.01, 0.02], "stragglers": [0, 1]}
    assert _axes(charts.binned_rank_time_chart(times).to_dict()) == {
        "x:step": ",d", "y:ms": "~r", "y:max_ms": "~r"}
    memory = charts.peak_memory_chart([{"rank": 0, "device": "cpu:0", "peak_memory_bytes": 3 * 2**20}])
    spec = memory.to_dict()
    assert spec["encoding"]["y"]["axis"]["format"] == ",~r" and spec["encoding"]["y"]["title"] == "MiB"
    columns = {"time": _times(3), "memory_used": [2**30] * 3, "memory_total": [2**31] * 3,
               "utilization_pct": [50.0] * 3}
    spec = charts.device_history_chart(columns, "memory_used", 1).to_dict()
    assert spec["layer"][0]["encoding"]["y"]["title"] == "GiB"
    assert spec["layer"][0]["encoding"]["x"]["type"] == "temporal"  # a time axis, in UTC
    assert spec["layer"][0]["encoding"]["x"]["scale"]["type"] == "utc"
    util = charts.device_history_chart(columns, "utilization_pct", 1).to_dict()
    assert util["encoding"]["y"]["axis"]["format"] == "~r" and util["encoding"]["y"]["title"] == "%"


# ---- run events, grouped -----------------------------------------------------------------------

def event(step: int, kind: str = "rebalance", message: str = "shares moved") -> dict:
    return {"step": step, "kind": kind, "message": message, "details": {}}


def test_few_events_are_one_mark_each_and_one_step_one_mark():
    events = [event(10), event(10, "balance_limited", "rank 1 slow"), event(30, "degraded")]
    groups = group_events(events)
    assert [(g["step"], g["count"], g["kind"]) for g in groups] == [
        (10, 2, "balance_limited"), (30, 1, "degraded")]
    assert groups[0]["kinds"] == "rebalanced, balance limited"
    assert groups[0]["listing"] == ("step 10 rebalanced: shares moved; "
                                    "step 10 balance limited: rank 1 slow")
    assert group_events([]) == [] and group_events(None) == []


def test_46_events_make_at_most_20_marks_and_every_event_is_counted():
    events = [event(1000 + 37 * i, "rebalance" if i % 9 else "balance_limited") for i in range(46)]
    groups = group_events(events)
    assert len(groups) <= 20
    assert sum(g["count"] for g in groups) == 46
    assert [g["start"] for g in groups] == sorted(g["start"] for g in groups)
    assert all(g["start"] <= g["end"] for g in groups)
    for g in groups:  # the tooltip lists a group's events, and counts those it leaves out
        listed = g["listing"].split("; ")
        assert len(listed) == min(g["count"], 6) + (g["count"] > 6)
    assert events_summary(events) == "46 run events: balance limited ×6, rebalanced ×40"
    assert kinds_text(events) == "balance limited ×6, rebalanced ×40"
    crowded = group_events([event(5)] * 30 + [event(7)], max_listed=3)
    assert [g["count"] for g in crowded] == [30, 1]
    assert crowded[0]["listing"].endswith("; and 27 more")
    with pytest.raises(ValueError):
        group_events(events, max_marks=0)


def test_the_chart_draws_the_groups_as_one_layer():
    events = [event(s) for s in range(5, 235, 5)]  # 46
    layers = charts.event_marks(events)
    assert len(layers) == 1
    rows = [row for data in layers[0].to_dict()["datasets"].values() for row in data]
    assert len(rows) <= 20 and sum(row["count"] for row in rows) == 46
    assert {row["color"] for row in rows} == {charts.EVENT_COLORS["rebalance"]}
    assert charts.event_marks([]) == []
    assert charts.event_marks(events, kinds=("degraded",)) == []

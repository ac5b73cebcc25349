"""A column's charts stacked as one Vega view (chart_stack): every chart keeps its title,
axes (the 24-hour UTC time axis included), tooltips and rows; None charts are left out."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pandas as pd
import vl_convert

from sae_dist.analytics import chart_stack, charts, units

START = datetime(2026, 11, 24, 19, 20, tzinfo=timezone.utc)


def device_columns(n: int = 30) -> dict[str, list]:
    return {"time": [START + timedelta(seconds=10 * i) for i in range(n)],
            "memory_used": [2**30 * 3] * n, "memory_total": [2**33] * n,
            "utilization_pct": [float(i) for i in range(n)], "power_w": [None] * n}


def test_a_stack_keeps_each_chart_whole_and_leaves_out_the_missing():
    cols = device_columns()
    panels = [charts.device_panel(cols, f, 10, total=True) for f in ("memory_used", "power_w",
                                                                     "utilization_pct")]
    assert panels[1].chart is None  # power not measured: no chart
    spec = chart_stack.stack([p.chart for p in panels]).to_dict()
    memory, util = spec["concat"]
    assert spec["columns"] == 1 and spec["resolve"]["scale"] == {"x": "independent", "y": "independent"}
    assert spec["autosize"] == {"type": "fit-x", "contains": "padding"}
    assert spec["params"] == [{"name": "width", "expr": chart_stack.CONTAINER_WIDTH}]
    assert memory["title"]["text"] == charts.TOTAL_TITLES["memory_used"]
    assert [layer["encoding"]["y"]["field"] for layer in memory["layer"]] == ["value", "total"]
    assert util["title"]["text"] == charts.TOTAL_TITLES["utilization_pct"]
    x = util["encoding"]["x"]
    assert x["title"] == "time (UTC)" and x["axis"]["format"] == "%H:%M" and x["scale"]["type"] == "utc"
    assert {t["title"] for t in util["encoding"]["tooltip"]} == {"Time (UTC)", "Utilisation (%)"}
    assert len(spec["datasets"]) == 2  # each chart its own rows


def test_a_lone_chart_stays_itself_and_nothing_gives_none():
    m = {"step": [10, 20], "loss": [1.0, 0.5]}
    chart = charts.training_panel(m, "loss").chart
    assert chart_stack.stack([None, chart, None]) is chart
    assert chart_stack.stack([None, None]) is None and chart_stack.stack([]) is None


def test_a_stack_draws_every_title_and_takes_the_width_it_is_given():
    m = {"step": list(range(10, 210, 10))}
    m.update(loss=[1 / s for s in m["step"]], fvu=[0.5 / s for s in m["step"]])
    stack = chart_stack.stack([charts.training_panel(m, k).chart for k in ("loss", "fvu")])
    svg = vl_convert.vegalite_to_svg(stack.to_dict())  # no container here: the fallback width
    assert units.TRAINING["loss"].title in svg and units.TRAINING["fvu"].title in svg
    width = int(svg.split('width="', 1)[1].split('"', 1)[0])
    assert 390 <= width <= 410  # axes fitted inside the width, not added to it


def _named_in_order(spec: dict) -> dict:
    """`spec` without its datasets, their names replaced by their order of first use (Altair
    names them by content, stack_spec by place)."""
    text = json.dumps({k: v for k, v in spec.items() if k not in ("datasets", "config")},
                      sort_keys=True)
    for i, name in enumerate(dict.fromkeys(re.findall(r'"name": "(data-[0-9a-f]+)"', text))):
        text = text.replace(f'"{name}"', f'"D{i}"')
    return json.loads(text)


def test_stack_spec_is_the_stack_altair_writes_with_its_rows_as_frames():
    cols = device_columns()
    m = {"step": list(range(10, 210, 10))}
    m.update(loss=[1 / s for s in m["step"]])
    events = [{"step": 50, "kind": "rebalance", "message": "moved 8 samples", "time": START}]
    groups = [[charts.device_panel(cols, f, 10, total=True).chart for f in ("memory_used",
                                                                             "utilization_pct")],
              [charts.training_panel(m, "loss", events).chart, None],
              [charts.device_panel(cols, "utilization_pct", 10).chart]]
    for group in groups:
        spec = chart_stack.stack_spec(group)
        altairs = chart_stack.stack(group).to_dict()
        if sum(chart is not None for chart in group) == 1:  # a lone chart also fits only its width
            altairs["autosize"] = dict(chart_stack.AUTOSIZE)
        assert _named_in_order(spec) == _named_in_order(altairs)
        frames = spec["datasets"]
        assert all(isinstance(f, pd.DataFrame) for f in frames.values())
        # Each chart's (or layer's) rows, once each: a frame two layers share is one dataset.
        names = set(re.findall(r'"name": "(data-\d+)"', json.dumps(
            {k: v for k, v in spec.items() if k != "datasets"})))
        assert names == set(frames) and list(frames) == [f"data-{i}" for i in range(len(frames))]
    memory = chart_stack.stack_spec(groups[0])["datasets"]["data-0"]
    assert list(memory.columns[:3]) == ["time", "value", "total"] and len(memory) == 30
    assert chart_stack.stack_spec([None]) is None and chart_stack.stack_spec([]) is None


def test_a_lone_chart_grows_to_hold_a_legend_taller_than_its_plot():
    # Eight ranks' legend under Streamlit's default "fit" was cut off at the chart's 220 px.
    times = {"width": 1, "step": [s for s in (10, 20) for _ in range(8)], "rank": list(range(8)) * 2,
             "device": [f"GPU-{i:08x}-0d4e" for i in range(8)] * 2,
             "mean_s": [0.1] * 16, "max_s": [0.1] * 16, "stragglers": [0] * 16}
    spec = chart_stack.stack_spec([charts.binned_rank_time_chart(times)])
    assert spec["autosize"] == {"type": "fit-x", "contains": "padding"}
    spec = {**spec, "width": 420, "datasets": {name: json.loads(frame.to_json(orient="records"))
                                               for name, frame in spec["datasets"].items()}}
    def height(s: dict) -> int:
        return int(vl_convert.vegalite_to_svg(s).split('height="', 1)[1].split('"', 1)[0])
    assert height(spec) >= charts.CHART_HEIGHT + 40 > height({**spec, "autosize": {"type": "fit"}})

"""Every chart against time labels its axis in 24-hour UTC clock times, titled "time (UTC)":
the specs say so (a "%H:%M" format on a UTC scale), and drawn by Vega in a process whose
local zone is New York the labels still read as UTC ("19:25", not "07:25" nor "14:25")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest

from sae_dist.analytics import charts, sparklines, time_axis

START = datetime(2026, 11, 24, 19, 20, tzinfo=timezone.utc)


def columns(n: int = 40, step_s: int = 30, start: datetime = START) -> dict[str, list]:
    return {"time": [start + timedelta(seconds=i * step_s) for i in range(n)],
            "memory_used": [2**30 * (1 + i % 3) for i in range(n)], "memory_total": [2**33] * n,
            "utilization_pct": [float(i % 100) for i in range(n)], "power_w": [None] * n,
            "temperature_c": [40.0 + i % 5 for i in range(n)]}


def x_encodings(spec: dict) -> list[dict]:
    layers = spec.get("layer", [spec])
    return [layer["encoding"]["x"] for layer in layers if "x" in layer.get("encoding", {})]


def assert_utc_clock_axis(x: dict, label_format: str = "%H:%M") -> None:
    assert x["type"] == "temporal" and x["scale"]["type"] == "utc"
    assert x["title"] == "time (UTC)"
    # The format alone: with formatType "utc" beside it Vega-Lite 6.4 drops it (12-hour labels).
    assert x["axis"]["format"] == label_format and "formatType" not in x["axis"]


def test_label_format_is_the_clock_within_a_day_with_seconds_or_date_beyond():
    day = [START, START + timedelta(hours=23)]
    assert time_axis.label_format(day) == "%H:%M"
    assert time_axis.label_format([START, START + timedelta(hours=25)]) == "%b %d, %H:%M"
    assert time_axis.label_format([]) == "%H:%M" and time_axis.label_format([None, START]) == "%H:%M"
    assert time_axis.label_format(pd.Series(pd.to_datetime([START, pd.NaT], utc=True))) == "%H:%M"
    # A minute on 3 ticks (every 15-30 s): "13:51" three times would say nothing.
    minute = [START, START + timedelta(seconds=60)]
    assert time_axis.label_format(minute, 3) == "%H:%M:%S"
    assert time_axis.label_format([START, START + timedelta(minutes=5)], 5) == "%H:%M"  # 1-minute ticks
    assert time_axis.label_format([START, START + timedelta(minutes=2)], 3) == "%H:%M:%S"
    assert time_axis.label_format([START, START + timedelta(minutes=3)], 3) == "%H:%M"


@pytest.mark.parametrize("seconds, ticks", [(60, 3), (60, 5), (120, 3), (150, 5), (200, 5), (300, 5),
                                            (130, 3), (1200, 3)])
def test_drawn_clock_labels_never_repeat(seconds, ticks):
    """Whatever the span, the labels Vega draws with the chosen format are distinct."""
    import vl_convert

    times = [START + timedelta(seconds=s) for s in range(0, seconds + 1, 5)]
    chart = sparklines.sparkline_chart({"time": times, "temperature_c": [40.0] * len(times)}, "temperature_c", 5)
    spec = chart.to_dict()
    spec["encoding"]["x"]["axis"]["tickCount"] = ticks
    spec["encoding"]["x"]["axis"]["format"] = time_axis.label_format(times, ticks)
    spec["width"] = 600  # wide enough that no label is dropped for overlapping
    texts = re.findall(r"<text[^>]*>(\d\d:\d\d(?::\d\d)?)</text>", vl_convert.vegalite_to_svg(spec))
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts


def test_device_charts_have_a_24_hour_utc_axis():
    for field in charts.DEVICE_PANELS:
        chart = charts.device_history_chart(columns(), field, 30)
        if field == "power_w":
            assert chart is None  # not measured: no chart, no axis
            continue
        xs = x_encodings(chart.to_dict())
        assert xs, field
        for x in xs:
            assert_utc_clock_axis(x)
    two_days = charts.device_history_chart(columns(n=50, step_s=3600), "utilization_pct", 3600).to_dict()
    assert_utc_clock_axis(x_encodings(two_days)[0], "%b %d, %H:%M")


def test_per_gpu_sparklines_have_a_time_axis():
    for field in ("memory_used", "utilization_pct", "temperature_c"):
        spec = sparklines.sparkline_chart(columns(), field, 30).to_dict()
        (x,) = x_encodings(spec)
        assert_utc_clock_axis(x)
        assert x["axis"]["tickCount"] == 3 and spec["encoding"]["y"]["axis"] is None
        assert spec["height"] == sparklines.HEIGHT
    assert sparklines.sparkline_chart(columns(), "power_w", 30) is None  # not measured
    assert sparklines.sparkline_chart({"time": [], "utilization_pct": []}, "utilization_pct", 1) is None


DRAW = """
import json, re, sys
import vl_convert
svg = vl_convert.vegalite_to_svg(json.loads(sys.stdin.read()))
print(json.dumps([re.sub(r"<[^>]+>", "", t) for t in re.findall(r"<text[^>]*>.*?</text>", svg)]))
"""


@pytest.mark.parametrize("build", ["device", "sparkline"])
def test_drawn_labels_are_utc_clock_times_in_another_zone(build):
    """19:20-19:39:30 UTC, drawn where local time is New York (UTC-5): the labels are 19:xx."""
    chart = (charts.device_history_chart(columns(), "temperature_c", 30) if build == "device"
             else sparklines.sparkline_chart(columns(), "temperature_c", 30))
    env = {**os.environ, "TZ": "America/New_York"}
    out = subprocess.run([sys.executable, "-c", DRAW], input=json.dumps(chart.to_dict()), env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    texts = json.loads(out.stdout)
    clock = [t for t in texts if re.fullmatch(r"\d\d:\d\d", t)]
    assert clock and all(t.startswith("19:") for t in clock), texts
    assert "time (UTC)" in texts


@pytest.mark.parametrize("build", ["device", "memory", "sparkline"])
def test_tooltips_write_the_time_in_utc(build):
    """Compiled to Vega, a time tooltip is utcFormat(...) (formatType "utc" would compile to
    Vega's date-from-parts `utc(...)`, not a format)."""
    import vl_convert

    chart = {"device": lambda: charts.device_history_chart(columns(), "temperature_c", 30),
             "memory": lambda: charts.device_history_chart(columns(), "memory_used", 30),
             "sparkline": lambda: sparklines.sparkline_chart(columns(), "utilization_pct", 30)}[build]()
    vega = json.dumps(vl_convert.vegalite_to_vega(chart.to_dict()))
    tooltips = re.findall(r'"tooltip": \{"signal": "((?:[^"\\]|\\.)*)"', vega)
    assert tooltips and all('utcFormat(datum[\\"utcyearmonthdatehoursminutesseconds_time\\"], '
                            '\\"%Y-%m-%d %H:%M:%S\\")' in t for t in tooltips), tooltips
    assert not re.search(r"[^A-Za-z]utc\(", vega)

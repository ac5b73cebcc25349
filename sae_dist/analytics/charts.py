"""Altair chart builders for training runs: curves against step, per-rank times, memory.

Inputs are the plain column-wise data of `queries`; every series is thinned by
`downsample` first, so a chart holds at most `MAX_ROWS_PER_CHART` rows however long the
run (Altair's `to_dict()` refuses more than 5,000, and browsers slow down well before).
A builder returns None when there is nothing measured to draw: the page then says so,
rather than drawing an empty or zero line. The `*_panel` builders return the chart with the
data frame it plots (`Panel`), so the metric card beside a chart is read from the very
points it draws (`cards`); titles and formats come from `units`. Run events are grouped
into a few marks (`events`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import altair as alt
import pandas as pd

from sae_dist import format as fmt
from sae_dist.analytics import units
from sae_dist.analytics.cards import Card, card_text, last_plotted_row, memory_text
from sae_dist.analytics.downsample import MAX_POINTS_PER_SERIES, downsample
from sae_dist.analytics.events import MAX_EVENT_MARKS, group_events, kinds_text
from sae_dist.analytics.time_axis import time_tooltip, time_x

METRIC_LABELS = {metric: unit.title for metric, unit in units.TRAINING.items()}
"""A step metric's chart title (units.TRAINING holds its formats too)."""

STRAGGLER_COLOR = "#d62728"
# Not blue: the ranks' lines take Streamlit's blues, and an event mark must not pass for one.
EVENT_COLORS = {"rebalance": "#57606a", "balance_limited": "#bf8700", "degraded": "#cf222e"}
OTHER_EVENT_COLOR = "#6e7781"
CHART_HEIGHT = 220
# What one run's page ships (Training runs): Chromium's time to draw a chart grows with its
# points, and a chart there is about 420 px wide at 1,400 px, so 1,000 points a curve (500
# min/max bins) and 1,200 rank-line rows show every spike a pixel can (2,000 and 3,000 before:
# about 0.2 s more per page load on the bench's 200,000-step run, scripts/bench_app.py).
RUN_CURVE_POINTS = 1_000
RANK_LINE_ROWS = 1_200


@dataclass
class Panel:
    """A chart and the data frame it draws: `frame` holds exactly the rows plotted (after
    bucketing and downsampling; a missing value stays None and is not drawn), so the card
    beside the chart is read from it (`card`). `chart` is None when nothing was measured."""

    frame: pd.DataFrame
    chart: alt.Chart | alt.LayerChart | None
    unit: units.Unit
    help: str | None = None

    @property
    def text(self) -> str:
        """The card's text: the chart's last plotted value, in its unit; "—" without one."""
        if "total" in self.frame:
            return memory_text(self.frame, self.unit)
        return card_text(self.frame, self.unit)

    def card(self, label: str) -> Card:
        return Card(label, self.text, self.help)


def step_x() -> alt.X:
    """The step axis: whole steps, thousands separated."""
    return alt.X("step:Q", title="Step",
                 axis=alt.Axis(format=units.STEP_AXIS_FORMAT, tickMinStep=1))


def value_y(unit: units.Unit, field: str = "value", **scale: Any) -> alt.Y:
    return alt.Y(f"{field}:Q", title=unit.axis_title, scale=alt.Scale(zero=False, **scale),
                 axis=alt.Axis(format=unit.axis))


def training_frame(metrics: dict[str, list], metric: str,
                   max_points: int = MAX_POINTS_PER_SERIES) -> pd.DataFrame:
    """The rows `training_curve` plots: the logged steps with a value of `metric`, thinned to
    at most `max_points` (downsample keeps the last one)."""
    steps, values = downsample(metrics["step"], metrics[metric], max_points)
    return pd.DataFrame({"step": pd.array(steps, dtype="Int64"),
                         "value": pd.array(values, dtype="Float64")})


def training_panel(metrics: dict[str, list], metric: str, events: list[dict] | None = None,
                   max_points: int = MAX_POINTS_PER_SERIES) -> Panel:
    """One metric against step (`metrics` from `queries.run_step_metrics`) and the data it
    plots; `events` (`queries.run_events`) as grouped marks. No chart when the run has no
    measured value of it yet."""
    return frame_panel(training_frame(metrics, metric, max_points), metric, events)


def frame_panel(data: pd.DataFrame, metric: str, events: list[dict] | None = None) -> Panel:
    """`training_panel` from its rows already thinned (`training_frame`: a page caches those,
    not the run's every logged step)."""
    unit = units.training_unit(metric)
    row = last_plotted_row(data)
    help_text = None if row is None else f"The chart's last point: step {int(row['step']):,}."
    if not len(data):
        return Panel(data, None, unit, help_text)
    line = alt.Chart(data).mark_line(point=len(data) <= 60, interpolate="linear").encode(
        x=step_x(), y=value_y(unit),
        tooltip=[alt.Tooltip("step:Q", title="Step", format=","),
                 alt.Tooltip("value:Q", title=unit.title, format=unit.value)])
    return Panel(data, _with_events([line], events, unit.title, None), unit, help_text)


def training_curve(metrics: dict[str, list], metric: str,
                   max_points: int = MAX_POINTS_PER_SERIES,
                   events: list[dict] | None = None) -> alt.Chart | alt.LayerChart | None:
    """`training_panel`'s chart alone; None if the run has no measured value of `metric`."""
    return training_panel(metrics, metric, events, max_points).chart


def peak_memory_chart(ranks: list[dict[str, Any]]) -> alt.Chart | None:
    """Peak memory per rank over the run (`queries.rank_summary` rows), in MiB; None when no
    rank measured it."""
    measured = [r for r in ranks if r["peak_memory_bytes"] is not None]
    if not measured:
        return None
    data = pd.DataFrame({
        "number": [r["rank"] for r in measured],
        "rank": [_rank_label(r["rank"], r["device"]) for r in measured],
        "mib": [r["peak_memory_bytes"] * units.PEAK_MEMORY.factor for r in measured],
    })
    return alt.Chart(data).mark_bar().encode(
        # The rank's number under its bar (eight "0 (GPU-5f3a2b1c)" labels overlapped and every
        # other one was dropped); its device in the tooltip.
        x=alt.X("number:O", title="Rank", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("mib:Q", title=units.PEAK_MEMORY.axis_title,
                axis=alt.Axis(format=units.PEAK_MEMORY.axis)),
        tooltip=[alt.Tooltip("rank:N", title="Rank"),
                 alt.Tooltip("mib:Q", title="Peak memory (MiB)", format=units.PEAK_MEMORY.value)],
    ).properties(title=units.PEAK_MEMORY.title, height=CHART_HEIGHT)


def _rank_label(rank: int, device: str | None) -> str:
    # A GPU's full UUID (40 characters) would be cut off in the legend, naming no GPU.
    return f"{rank} ({fmt.short_device(device)})" if device else str(rank)


# ---- device readings over time (Monitor) ----------------------------------------------------

DEVICE_PANELS = {field: (None if field != "utilization_pct" else (0, 100))
                 for field in units.DEVICE}
"""The four device series, in the Monitor's order, with a fixed value domain where one fits
(units.DEVICE holds their titles and formats)."""

TOTAL_TITLES = {"memory_used": "Memory used (all devices)", "utilization_pct": "Mean utilisation",
                "power_w": "Total power", "temperature_c": "Hottest temperature"}

COUNT_FIELDS = {"memory_used": "memory_devices", "power_w": "power_devices"}
"""The count of devices a total series says it covers, by field (`samples.total_series`)."""
GAP_WIDTHS = 3  # buckets missing in a row before a line breaks (the sampler jitters by one)
MIN_GAP_S = 10


def _with_gaps(times: list, values: list, width_s: int) -> tuple[list, list]:
    """Insert a None point where readings stop for a while (daemon down, device gone), so the
    line breaks there rather than drawing a straight line through time nobody measured."""
    out_t, out_v = [], []
    limit = max(GAP_WIDTHS * width_s, MIN_GAP_S)
    for i, (t, v) in enumerate(zip(times, values)):
        if i and (t - times[i - 1]).total_seconds() > limit:
            out_t.append(times[i - 1] + (t - times[i - 1]) / 2)
            out_v.append(None)
        out_t.append(t)
        out_v.append(v)
    return out_t, out_v


def _time_axis(times) -> alt.X:
    # 24-hour UTC labels, titled "time (UTC)", whatever the browser's zone (time_axis).
    return time_x(times)


def device_frame(columns: dict[str, list], field: str, width_s: int) -> pd.DataFrame:
    """The rows a device chart plots: time, value (in the plotted unit, None where not
    measured or where readings stopped) and, for memory, the devices' total at each point."""
    unit = units.DEVICE[field]
    values = columns.get(field, [])
    times, scaled = _with_gaps(columns["time"],
                               [None if v is None else v * unit.factor for v in values], width_s)
    data = pd.DataFrame({"time": pd.to_datetime(times, utc=True),
                         "value": pd.array(scaled, dtype="Float64")})
    if field == "memory_used" and any(v is not None for v in columns.get("memory_total", [])):
        capacity = [None if v is None else v * unit.factor for v in columns["memory_total"]]
        data["total"] = pd.array(_with_gaps(columns["time"], capacity, width_s)[1],
                                 dtype="Float64")
    for name in ("devices", COUNT_FIELDS.get(field)):  # over several devices: how many counted
        if name in columns:
            data[name] = pd.array(_with_gaps(columns["time"], columns[name], width_s)[1],
                                  dtype="Int64")
    return data


def device_panel(columns: dict[str, list], field: str, width_s: int, *, title: str | None = None,
                 height: int = 170, total: bool = False) -> Panel:
    """One device series against time (UTC), from `samples.Series.columns`, and the data it
    plots; no chart when none of its points was measured (a virtual device's power), so the
    page says "not measured".

    Memory is drawn as GiB used with the devices' total as a dashed line; utilisation on a
    fixed 0-100 % scale. `total=True` titles it for several devices (TOTAL_TITLES).
    """
    if field not in DEVICE_PANELS:
        raise ValueError(f"field must be one of {', '.join(DEVICE_PANELS)}, got {field!r}")
    unit, domain = units.DEVICE[field], DEVICE_PANELS[field]
    data = device_frame(columns, field, width_s)
    every = f"each point: {span_label(width_s)}"
    if not data["value"].notna().any():
        return Panel(data, None, unit, every)
    name = title or (TOTAL_TITLES[field] if total else unit.title)
    scale = alt.Scale(domain=list(domain)) if domain else alt.Scale(zero=False, nice=True)
    when = time_tooltip()
    tooltip = [when, alt.Tooltip("value:Q", title=f"{unit.title} ({unit.axis_title})",
                                 format=unit.value)]
    x = _time_axis(data["time"])
    y = alt.Y("value:Q", title=unit.axis_title, scale=scale, axis=alt.Axis(format=unit.axis))
    line = alt.Chart(data).mark_line(interpolate="monotone", invalid=None,
                                     point=len(data) <= 2).encode(x=x, y=y, tooltip=tooltip)
    if "total" in data:
        limit = alt.Chart(data).mark_line(strokeDash=[4, 3], color="gray", invalid=None).encode(
            x=x, y=alt.Y("total:Q", title=unit.axis_title, scale=scale,
                         axis=alt.Axis(format=unit.axis)),
            tooltip=[when, alt.Tooltip("total:Q", title=f"Total ({unit.axis_title})",
                                       format=unit.value)])
        chart = alt.layer(line, limit).properties(
            title=alt.TitleParams(name, subtitle=f"dashed: total · {every}"), height=height)
        return Panel(data, chart, unit, every)
    chart = line.properties(title=alt.TitleParams(name, subtitle=every), height=height)
    return Panel(data, chart, unit, every)


def device_history_chart(columns: dict[str, list], field: str, width_s: int, *,
                         title: str | None = None, height: int = 170,
                         total: bool = False) -> alt.LayerChart | alt.Chart | None:
    """`device_panel`'s chart alone; None when none of its points was measured."""
    return device_panel(columns, field, width_s, title=title, height=height, total=total).chart


def span_label(seconds: int) -> str:
    if seconds < 60:
        return "one reading" if seconds <= 1 else f"mean of {seconds} s"
    if seconds < 3600:
        return f"mean of {seconds // 60} min"
    return f"mean of {seconds / 3600:g} h"


# ---- training curves bucketed by step (Monitor) ---------------------------------------------

def binned_frame(curves: dict[str, list], metric: str) -> pd.DataFrame:
    """The rows `binned_curve` plots: each bucket's last logged step, mean, min and max, for
    the buckets where `metric` was measured."""
    rows = [(s, v, lo, hi) for s, v, lo, hi in zip(curves["step"], curves.get(metric, []),
                                                    curves.get(f"{metric}_min", []),
                                                    curves.get(f"{metric}_max", []))
            if v is not None]
    return pd.DataFrame({"step": pd.array([r[0] for r in rows], dtype="Int64"),
                         **{name: pd.array([r[i] for r in rows], dtype="Float64")
                            for i, name in enumerate(("value", "low", "high"), 1)}})


def binned_panel(curves: dict[str, list], metric: str, events: list[dict] | None = None
                 ) -> Panel:
    """A metric against step from `samples.run_curves` and the data it plots: the mean of each
    bucket of steps as a line, its min-max as a band (only where a bucket holds several logged
    steps); `events` (`queries.run_events`) as grouped marks. No chart when the metric was
    never measured."""
    unit = units.training_unit(metric)
    data = binned_frame(curves, metric)
    width = curves.get("width", 1)
    row = last_plotted_row(data)
    if row is None:
        help_text = None
    elif width <= 1:
        help_text = f"The chart's last point: step {int(row['step']):,}."
    else:
        help_text = (f"The chart's last point: the mean of the logged steps in its bucket of "
                     f"{width:,} steps, up to step {int(row['step']):,}.")
    if not len(data):
        return Panel(data, None, unit, help_text)
    tooltip = [alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("value:Q", title=unit.title, format=unit.value)]
    line = alt.Chart(data).mark_line(point=len(data) <= 60).encode(
        x=step_x(), y=value_y(unit), tooltip=tooltip)
    if width <= 1 or (data["low"] == data["high"]).all():
        return Panel(data, _with_events([line], events, unit.title, None), unit, help_text)
    band = alt.Chart(data).mark_area(opacity=0.25).encode(
        x=step_x(), y=value_y(unit, "low"), y2="high:Q",
        tooltip=[*tooltip, alt.Tooltip("low:Q", title="Min", format=unit.value),
                 alt.Tooltip("high:Q", title="Max", format=unit.value)])
    chart = _with_events([band, line], events, unit.title,
                         f"mean of every {width:,} steps; band: min-max")
    return Panel(data, chart, unit, help_text)


def binned_curve(curves: dict[str, list], metric: str, events: list[dict] | None = None
                 ) -> alt.LayerChart | alt.Chart | None:
    """`binned_panel`'s chart alone; None when the metric was never measured."""
    return binned_panel(curves, metric, events).chart


def binned_rank_time_chart(times: dict[str, list], field: str = "step_time_s",
                           events: list[dict] | None = None) -> alt.LayerChart | None:
    """Per-rank time per step from `samples.rank_times`, one line per rank (bucket means, ms);
    a red triangle at the bucket's slowest step wherever a rank straggled; `events` as
    vertical rules (a rebalance is where the lines should draw together). None without data."""
    if not times["step"]:
        return None
    labels = [_rank_label(r, d) for r, d in zip(times["rank"], times["device"])]
    data = pd.DataFrame({"step": times["step"], "rank": labels,
                         "ms": [None if v is None else v * units.RANK_TIME.factor
                                for v in times["mean_s"]],
                         "max_ms": [None if v is None else v * units.RANK_TIME.factor
                                    for v in times["max_s"]],
                         "stragglers": times["stragglers"]})
    title = "Step time per rank" if field == "step_time_s" else "Compute time per rank"
    x = step_x()
    unit = units.RANK_TIME
    tooltip = [alt.Tooltip("rank:N", title="Rank"), alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("ms:Q", title="Mean (ms)", format=unit.value)]
    line = alt.Chart(data).mark_line().encode(
        x=x, y=value_y(unit, "ms"),
        color=alt.Color("rank:N", title="Rank"), tooltip=tooltip)
    flagged = data[data["stragglers"] > 0]  # a layer only when some are: an empty one makes Vega warn
    marks = [] if flagged.empty else [alt.Chart(flagged).mark_point(
        shape="triangle-up", filled=True, size=70, color=STRAGGLER_COLOR, opacity=0.9,
    ).encode(x=x, y=value_y(unit, "max_ms"),
             tooltip=[*tooltip[:2], alt.Tooltip("max_ms:Q", title="Slowest (ms)", format=unit.value),
                      alt.Tooltip("stragglers:Q", title="Straggler steps")])]
    count = int(data["stragglers"].sum())
    subtitle = (f"{count:,} straggler steps (red)" if count else "no straggler flagged")
    if times.get("width", 1) > 1:
        subtitle += f" · mean of every {times['width']:,} steps"
    return _with_events([line, *marks], events, title, subtitle)


# ---- run events, grouped -------------------------------------------------------------------

def event_marks(events: list[dict] | None, kinds: tuple[str, ...] | None = None,
                max_marks: int = MAX_EVENT_MARKS) -> list[alt.Chart]:
    """Run events (`queries.run_events`) as one layer of at most `max_marks` vertical rules:
    events close in steps are grouped (`events.group_events`) into one rule, thicker the more
    it holds, its tooltip counting and listing them; coloured by kind with fixed colours (no
    colour scale: it would merge with the ranks' legend). Only `kinds` when given; [] without
    events."""
    chosen = [e for e in events or [] if kinds is None or e["kind"] in kinds]
    groups = group_events(chosen, max_marks)
    if not groups:
        return []
    data = pd.DataFrame([{**g, "color": EVENT_COLORS.get(g["kind"], OTHER_EVENT_COLOR),
                          "width": 1.5 + min(g["count"] - 1, 8) * 0.5} for g in groups])
    return [alt.Chart(data).mark_rule(strokeDash=[5, 3], opacity=0.6).encode(
        x=step_x(), color=alt.Color("color:N", scale=None),
        strokeWidth=alt.StrokeWidth("width:Q", scale=None),
        tooltip=[alt.Tooltip("start:Q", title="From step", format=","),
                 alt.Tooltip("end:Q", title="To step", format=","),
                 alt.Tooltip("count:Q", title="Run events"),
                 alt.Tooltip("kinds:N", title="What happened"),
                 alt.Tooltip("listing:N", title="Events")])]


def event_rules(events: list[dict] | None, kinds: tuple[str, ...] | None = None) -> list[alt.Chart]:
    """`event_marks` (kept for callers of its former name)."""
    return event_marks(events, kinds)


def events_subtitle(events: list[dict] | None) -> str | None:
    """"dashed: rebalanced ×44, balance limited ×2" for the events drawn; None without."""
    kinds = kinds_text(events)
    return f"dashed: {kinds}" if kinds else None


def _with_events(layers: list[alt.Chart], events: list[dict] | None, title: str,
                 subtitle: str | None) -> alt.Chart | alt.LayerChart:
    """The chart's layers with the event marks on top, titled; a lone layer stays a plain
    chart when there is no event (the spec of a chart without events does not change)."""
    marks = event_marks(events)
    subtitle = " · ".join(p for p in (subtitle, events_subtitle(events)) if p) or None
    heading = alt.TitleParams(title, subtitle=subtitle) if subtitle else title
    if len(layers) == 1 and not marks:
        return layers[0].properties(title=heading, height=CHART_HEIGHT)
    return alt.layer(*layers, *marks).properties(title=heading, height=CHART_HEIGHT)

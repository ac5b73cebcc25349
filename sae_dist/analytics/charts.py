"""Altair chart builders for training runs: curves against step, per-rank times, memory.

Inputs are the plain column-wise data of `queries`; every series is thinned by
`downsample` first, so a chart holds at most `MAX_ROWS_PER_CHART` rows however long the
run (Altair's `to_dict()` refuses more than 5,000, and browsers slow down well before).
A builder returns None when there is nothing measured to draw: the page then says so,
rather than drawing an empty or zero line.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from sae_dist.analytics.downsample import (
    MAX_POINTS_PER_SERIES,
    MAX_ROWS_PER_CHART,
    downsample,
    downsample_indices,
    points_per_series,
)
from sae_dist.analytics.format import event_label

METRIC_LABELS = {
    "loss": "Loss",
    "mse": "MSE",
    "fvu": "FVU (fraction of variance unexplained)",
    "explained_variance": "Explained variance",
    "l0": "L0 (active latents per sample)",
    "dead_fraction": "Dead latents (fraction)",
    "auxk_loss": "AuxK loss",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm",
    "samples_per_s": "Throughput (samples/s)",
    "recovery_frac": "Planted features recovered (cosine > 0.9)",
    "recovery_mean_cos": "Mean best cosine to a planted feature",
}
METRIC_FORMATS = {"dead_fraction": ".1%", "explained_variance": ".3f", "l0": ".2f", "lr": ".2e",
                  "recovery_frac": ".1%", "recovery_mean_cos": ".3f"}

STRAGGLER_COLOR = "#d62728"
# Not blue: the ranks' lines take Streamlit's blues, and a rule must not pass for one of them.
EVENT_COLORS = {"rebalance": "#57606a", "balance_limited": "#bf8700", "degraded": "#cf222e"}
OTHER_EVENT_COLOR = "#6e7781"
MAX_EVENT_RULES = 200  # rules a kind draws at most: beyond that they merge into a band anyway
CHART_HEIGHT = 220
STRAGGLER_BUDGET = 1_000  # rows of straggler marks per chart, out of MAX_ROWS_PER_CHART


def training_curve(metrics: dict[str, list], metric: str,
                   max_points: int = MAX_POINTS_PER_SERIES) -> alt.Chart | None:
    """One metric against step (`metrics` from `queries.run_step_metrics`); None if the run
    has no measured value of it yet."""
    steps, values = downsample(metrics["step"], metrics[metric], max_points)
    if not steps:
        return None
    label = METRIC_LABELS.get(metric, metric)
    value_format = METRIC_FORMATS.get(metric, ".4g")
    # "~g" (trailing zeros trimmed) keeps ticks of a nearly flat series apart (L0 of a TopK
    # SAE: 3.9998, 4) where a fixed precision would print one label five times.
    axis = alt.Axis(format=value_format if value_format.endswith("%") else "~g")
    data = pd.DataFrame({"step": steps, "value": values})
    line = alt.Chart(data).mark_line(point=len(steps) <= 60, interpolate="linear")
    return line.encode(
        x=alt.X("step:Q", title="Step"),
        y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False),
                axis=axis),
        tooltip=[alt.Tooltip("step:Q", title="Step", format=","),
                 alt.Tooltip("value:Q", title=label, format=value_format)],
    ).properties(title=label, height=CHART_HEIGHT)


def rank_time_chart(stats: dict[str, list], field: str = "step_time_s") -> alt.LayerChart | None:
    """Per-rank `field` ("step_time_s" or "compute_time_s", seconds) against step, one line
    per rank, stragglers marked as red triangles; None without rank stats."""
    if field not in ("step_time_s", "compute_time_s"):
        raise ValueError(f"field must be step_time_s or compute_time_s, got {field!r}")
    ranks = sorted(set(stats["rank"]))
    if not ranks:
        return None
    per_series = points_per_series(len(ranks), MAX_ROWS_PER_CHART - STRAGGLER_BUDGET)
    lines: dict[str, list] = {"step": [], "rank": [], "ms": []}
    marks: dict[str, list] = {"step": [], "rank": [], "ms": []}
    for rank in ranks:
        rows = [i for i, r in enumerate(stats["rank"]) if r == rank]
        label = _rank_label(rank, stats["device"][rows[-1]])
        values = [stats[field][i] for i in rows]
        for j in downsample_indices(values, per_series):
            lines["step"].append(stats["step"][rows[j]])
            lines["rank"].append(label)
            lines["ms"].append(1000 * values[j])
        flagged = [j for j, i in enumerate(rows) if stats["is_straggler"][i]]
        keep = downsample_indices([values[j] for j in flagged],
                                  max(4, STRAGGLER_BUDGET // len(ranks)))
        for k in keep:
            j = flagged[k]
            marks["step"].append(stats["step"][rows[j]])
            marks["rank"].append(label)
            marks["ms"].append(1000 * values[j])
    title = "Step time per rank" if field == "step_time_s" else "Compute time per rank"
    tooltip = [alt.Tooltip("rank:N", title="Rank"), alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("ms:Q", title="Time (ms)", format=".2f")]
    x = alt.X("step:Q", title="Step")
    y = alt.Y("ms:Q", title="ms", scale=alt.Scale(zero=False))
    line = alt.Chart(pd.DataFrame(lines)).mark_line().encode(
        x=x, y=y, color=alt.Color("rank:N", title="Rank"), tooltip=tooltip)
    straggler = alt.Chart(pd.DataFrame(marks)).mark_point(
        shape="triangle-up", filled=True, size=70, color=STRAGGLER_COLOR, opacity=0.9,
    ).encode(x=x, y=y, tooltip=[*tooltip, alt.Tooltip("straggler:N", title="Straggler")]
             ).transform_calculate(straggler="'yes'")
    subtitle = (f"{sum(stats['is_straggler'])} straggler marks (red)" if any(stats["is_straggler"])
                else "no straggler flagged")
    return alt.layer(line, straggler).properties(
        title=alt.TitleParams(title, subtitle=subtitle), height=CHART_HEIGHT)


def peak_memory_chart(ranks: list[dict[str, Any]]) -> alt.Chart | None:
    """Peak memory per rank over the run (`queries.rank_summary` rows), in MiB; None when no
    rank measured it."""
    measured = [r for r in ranks if r["peak_memory_bytes"] is not None]
    if not measured:
        return None
    data = pd.DataFrame({
        "rank": [_rank_label(r["rank"], r["device"]) for r in measured],
        "mib": [r["peak_memory_bytes"] / 2**20 for r in measured],
    })
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("rank:N", title="Rank", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("mib:Q", title="MiB"),
        tooltip=[alt.Tooltip("rank:N", title="Rank"),
                 alt.Tooltip("mib:Q", title="Peak memory (MiB)", format=",.1f")],
    ).properties(title="Peak memory per rank", height=CHART_HEIGHT)


def _rank_label(rank: int, device: str | None) -> str:
    return f"{rank} ({device})" if device else str(rank)


# ---- device readings over time (Monitor) ----------------------------------------------------

DEVICE_PANELS = {
    # field: (title, unit, scale factor from the stored unit, value format, fixed domain)
    "memory_used": ("Memory used", "GiB", 1 / 2**30, ".1f", None),
    "utilization_pct": ("Utilisation", "%", 1.0, ".0f", (0, 100)),
    "power_w": ("Power", "W", 1.0, ".0f", None),
    "temperature_c": ("Temperature", "°C", 1.0, ".0f", None),
}
"""The four device series, in the Monitor's order."""

TOTAL_TITLES = {"memory_used": "Memory used (all devices)", "utilization_pct": "Mean utilisation",
                "power_w": "Total power", "temperature_c": "Hottest temperature"}

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


def _time_axis() -> alt.X:
    return alt.X("time:T", title=None, scale=alt.Scale(type="utc"),
                 axis=alt.Axis(labelOverlap=True, tickCount=5))


def device_history_chart(columns: dict[str, list], field: str, width_s: int, *,
                         title: str | None = None, height: int = 170,
                         total: bool = False) -> alt.LayerChart | alt.Chart | None:
    """One device series against time (UTC), from `samples.Series.columns`; None when none
    of its points was measured (a virtual device's power), so the page says "not measured".

    Memory is drawn as GiB used with the devices' total as a dashed line; utilisation on a
    fixed 0-100 % scale. `total=True` titles it for several devices (TOTAL_TITLES).
    """
    if field not in DEVICE_PANELS:
        raise ValueError(f"field must be one of {', '.join(DEVICE_PANELS)}, got {field!r}")
    label, unit, factor, value_format, domain = DEVICE_PANELS[field]
    values = columns.get(field, [])
    if not any(v is not None for v in values):
        return None
    times, scaled = _with_gaps(columns["time"],
                               [None if v is None else v * factor for v in values], width_s)
    data = pd.DataFrame({"time": pd.to_datetime(times, utc=True),
                         "value": pd.array(scaled, dtype="Float64")})
    name = title or (TOTAL_TITLES[field] if total else label)
    scale = alt.Scale(domain=list(domain)) if domain else alt.Scale(zero=False, nice=True)
    tooltip = [alt.Tooltip("time:T", title="Time (UTC)", format="%Y-%m-%d %H:%M:%S",
                           formatType="utc"),
               alt.Tooltip("value:Q", title=f"{label} ({unit})", format=value_format)]
    x = _time_axis()
    y = alt.Y("value:Q", title=unit, scale=scale)
    line = alt.Chart(data).mark_line(interpolate="monotone", invalid=None,
                                     point=len(data) <= 2).encode(x=x, y=y, tooltip=tooltip)
    every = f"each point: {span_label(width_s)}"
    if field == "memory_used" and any(v is not None for v in columns.get("memory_total", [])):
        capacity = [None if v is None else v * factor for v in columns["memory_total"]]
        cap_t, cap_v = _with_gaps(columns["time"], capacity, width_s)
        caps = pd.DataFrame({"time": pd.to_datetime(cap_t, utc=True),
                             "value": pd.array(cap_v, dtype="Float64")})
        limit = alt.Chart(caps).mark_line(strokeDash=[4, 3], color="gray", invalid=None).encode(
            x=x, y=y, tooltip=[tooltip[0], alt.Tooltip("value:Q", title="Total (GiB)",
                                                       format=".1f")])
        return alt.layer(line, limit).properties(
            title=alt.TitleParams(name, subtitle=f"dashed: total · {every}"), height=height)
    return line.properties(title=alt.TitleParams(name, subtitle=every), height=height)


def span_label(seconds: int) -> str:
    if seconds < 60:
        return "one reading" if seconds <= 1 else f"mean of {seconds} s"
    if seconds < 3600:
        return f"mean of {seconds // 60} min"
    return f"mean of {seconds / 3600:g} h"


# ---- training curves bucketed by step (Monitor) ---------------------------------------------

def binned_curve(curves: dict[str, list], metric: str, events: list[dict] | None = None
                 ) -> alt.LayerChart | alt.Chart | None:
    """A metric against step from `samples.run_curves`: the mean of each bucket of steps as a
    line, its min-max as a band (only where a bucket holds several logged steps); `events`
    (`queries.run_events`) as vertical rules. None when the metric was never measured."""
    means = curves.get(metric, [])
    rows = [(s, v, lo, hi) for s, v, lo, hi in zip(curves["step"], means, curves[f"{metric}_min"],
                                                    curves[f"{metric}_max"]) if v is not None]
    if not rows:
        return None
    label = METRIC_LABELS.get(metric, metric)
    value_format = METRIC_FORMATS.get(metric, ".4g")
    axis = alt.Axis(format=value_format if value_format.endswith("%") else "~g")
    data = pd.DataFrame(rows, columns=["step", "value", "low", "high"])
    x = alt.X("step:Q", title="Step")
    tooltip = [alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("value:Q", title=label, format=value_format)]
    line = alt.Chart(data).mark_line(point=len(data) <= 60).encode(
        x=x, y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False), axis=axis),
        tooltip=tooltip)
    width = curves.get("width", 1)
    if width <= 1 or (data["low"] == data["high"]).all():
        return _with_events([line], events, label, None)
    band = alt.Chart(data).mark_area(opacity=0.25).encode(
        x=x, y=alt.Y("low:Q", title=None, scale=alt.Scale(zero=False), axis=axis), y2="high:Q",
        tooltip=[*tooltip, alt.Tooltip("low:Q", title="Min", format=value_format),
                 alt.Tooltip("high:Q", title="Max", format=value_format)])
    return _with_events([band, line], events, label,
                        f"mean of every {width:,} steps; band: min-max")


def binned_rank_time_chart(times: dict[str, list], field: str = "step_time_s",
                           events: list[dict] | None = None) -> alt.LayerChart | None:
    """Per-rank time per step from `samples.rank_times`, one line per rank (bucket means, ms);
    a red triangle at the bucket's slowest step wherever a rank straggled; `events` as
    vertical rules (a rebalance is where the lines should draw together). None without data."""
    if not times["step"]:
        return None
    labels = [_rank_label(r, d) for r, d in zip(times["rank"], times["device"])]
    data = pd.DataFrame({"step": times["step"], "rank": labels,
                         "ms": [None if v is None else 1000 * v for v in times["mean_s"]],
                         "max_ms": [None if v is None else 1000 * v for v in times["max_s"]],
                         "stragglers": times["stragglers"]})
    title = "Step time per rank" if field == "step_time_s" else "Compute time per rank"
    x = alt.X("step:Q", title="Step")
    tooltip = [alt.Tooltip("rank:N", title="Rank"), alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("ms:Q", title="Mean (ms)", format=".2f")]
    line = alt.Chart(data).mark_line().encode(
        x=x, y=alt.Y("ms:Q", title="ms", scale=alt.Scale(zero=False)),
        color=alt.Color("rank:N", title="Rank"), tooltip=tooltip)
    flagged = data[data["stragglers"] > 0]
    marks = alt.Chart(flagged).mark_point(
        shape="triangle-up", filled=True, size=70, color=STRAGGLER_COLOR, opacity=0.9,
    ).encode(x=x, y=alt.Y("max_ms:Q"),
             tooltip=[*tooltip[:2], alt.Tooltip("max_ms:Q", title="Slowest (ms)", format=".2f"),
                      alt.Tooltip("stragglers:Q", title="Straggler steps")])
    count = int(data["stragglers"].sum())
    subtitle = (f"{count:,} straggler steps (red)" if count else "no straggler flagged")
    if times.get("width", 1) > 1:
        subtitle += f" · mean of every {times['width']:,} steps"
    return _with_events([line, marks], events, title, subtitle)


# ---- run events as vertical rules -----------------------------------------------------------

def event_rules(events: list[dict] | None, kinds: tuple[str, ...] | None = None) -> list[alt.Chart]:
    """Vertical dashed rules at the steps of run events (`queries.run_events`), one layer per
    kind in a fixed colour (no colour scale: it would merge with the ranks' legend); only
    `kinds` when given. [] without events."""
    chosen = [e for e in events or [] if kinds is None or e["kind"] in kinds]
    layers = []
    for kind in dict.fromkeys(e["kind"] for e in chosen):
        rows = [{"step": e["step"], "event": event_label(kind), "message": e["message"]}
                for e in chosen if e["kind"] == kind]
        kept = downsample_indices([r["step"] for r in rows], MAX_EVENT_RULES, keep="last")
        rows = [rows[i] for i in kept]
        layers.append(alt.Chart(pd.DataFrame(rows)).mark_rule(
            color=EVENT_COLORS.get(kind, OTHER_EVENT_COLOR), strokeDash=[5, 3], strokeWidth=1.5,
        ).encode(x=alt.X("step:Q", title="Step"),
                 tooltip=[alt.Tooltip("step:Q", title="Step", format=","),
                          alt.Tooltip("event:N", title="Event"),
                          alt.Tooltip("message:N", title="What happened")]))
    return layers


def events_subtitle(events: list[dict] | None) -> str | None:
    """"dashed: rebalanced, continued on fewer devices" for the kinds drawn; None without."""
    kinds = list(dict.fromkeys(event_label(e["kind"]) for e in events or []))
    return f"dashed: {', '.join(kinds)}" if kinds else None


def _with_events(layers: list[alt.Chart], events: list[dict] | None, title: str,
                 subtitle: str | None) -> alt.Chart | alt.LayerChart:
    """The chart's layers with the event rules on top, titled; a lone layer stays a plain
    chart when there is no event (the spec of a run without events does not change)."""
    rules = event_rules(events)
    subtitle = " · ".join(p for p in (subtitle, events_subtitle(events)) if p) or None
    heading = alt.TitleParams(title, subtitle=subtitle) if subtitle else title
    if len(layers) == 1 and not rules:
        return layers[0].properties(title=heading, height=CHART_HEIGHT)
    return alt.layer(*layers, *rules).properties(title=heading, height=CHART_HEIGHT)

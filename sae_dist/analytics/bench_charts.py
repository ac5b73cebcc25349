"""Altair charts of benchmarks and heterogeneous runs: the Benchmarks page and the HTML report.

Scaling (`speedup_chart`, `efficiency_chart`): measured series are solid with points; the
ideal line, the targets and the projection are drawn apart (dashed or hollow) and say what
they are in the legend: a projection is a model. A measured point that fails the reliability
checks (sae_dist.bench.reliability) is drawn hollow and grey, with its reason in the tooltip,
and the measured line does not pass through it.

Heterogeneous runs (`rank_time_chart`): each rank's time per step, the rebalances marked.
The figures come from `sae_dist.bench` (summary, balance); this module only draws them.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from sae_dist.analytics import units
from sae_dist.analytics.chart_stack import fit_width
from sae_dist.analytics.charts import CHART_HEIGHT, event_marks, events_subtitle, step_x, value_y
from sae_dist.analytics.downsample import MAX_ROWS_PER_CHART, downsample_indices, points_per_series
from sae_dist.bench import scaling
from sae_dist.format import MISSING

MARKED_EVENTS = ("rebalance", "degraded")  # the events that change who computes what

TARGET = f"target ({', '.join(f'{v}x on {n}' for n, v in scaling.TARGET_SPEEDUP.items())})"
SERIES_ORDER = ["measured (DDP)", "ceiling (no communication)", "ideal (N x)", TARGET,
                "projected, no overlap", "projected, full overlap"]
SERIES_COLORS = ["#1f6feb", "#8250df", "#8c959f", "#cf222e", "#bf8700", "#1a7f37"]
UNRELIABLE_COLOR = "#8c959f"
MEASURED = ["measured (DDP)", "ceiling (no communication)"]
PROJECTED = ["projected, no overlap", "projected, full overlap"]
COLUMNS = ["devices", "speedup", "series", "reliable", "reason"]


def legend(title: str | None = None) -> alt.Legend:
    """Below the plot, every label whole: on the right, a lone chart's legend was cut off by the
    page's width (the plot takes it all), and Vega's default cuts labels at 160 px."""
    return alt.Legend(title=title, orient="bottom", direction="horizontal", labelLimit=0, columns=3)


def speedup_frame(rows: list[dict], projection: list[dict] | None = None) -> pd.DataFrame:
    """Long-form (devices, speedup, series, reliable, reason) rows: measured, ceiling, ideal,
    targets, projection. Only measured rows can be unreliable (reliable False, reason why)."""
    records = []
    counts = sorted({r["devices"] for r in rows} | {p["devices"] for p in projection or []} | {1})

    def add(n, speedup, series, row=None):
        ok = True if row is None else bool(row.get("reliable", True))
        records.append({"devices": n, "speedup": speedup, "series": series, "reliable": ok,
                        "reason": None if ok else row.get("reason")})

    for r in rows:
        if r["speedup"] is not None:
            add(r["devices"], r["speedup"], "measured (DDP)", r)
        if r.get("ceiling_speedup") is not None:
            add(r["devices"], r["ceiling_speedup"], "ceiling (no communication)", r)
    for n in counts:
        add(n, float(n), "ideal (N x)")
        if n in scaling.TARGET_SPEEDUP:
            add(n, scaling.TARGET_SPEEDUP[n], TARGET)
    for p in projection or []:
        add(p["devices"], p["speedup_no_overlap"], "projected, no overlap")
        add(p["devices"], p["speedup_overlap"], "projected, full overlap")
    return pd.DataFrame.from_records(records, columns=COLUMNS)


def speedup_chart(rows: list[dict], projection: list[dict] | None = None, title: str = "Speedup") -> alt.Chart:
    """One layer per kind of mark that has rows (an empty layer made Vega warn of an infinite
    extent), and a colour key of the series drawn in colour: a measured series whose points
    are all unreliable is drawn hollow and grey, and keyed by shape under "Unreliable"."""
    data = speedup_frame(rows, projection)
    unreliable_rows = data[data.series.isin(MEASURED) & ~data.reliable]
    coloured = data[~data.index.isin(unreliable_rows.index)]
    drawn = [s for s in SERIES_ORDER if s in set(coloured.series)]
    color = alt.Color("series:N", legend=legend(), scale=alt.Scale(
        domain=drawn, range=[SERIES_COLORS[SERIES_ORDER.index(s)] for s in drawn]))
    x = alt.X("devices:Q", title="Devices", scale=alt.Scale(nice=False), axis=alt.Axis(tickMinStep=1))
    y = alt.Y("speedup:Q", title="Speedup over 1 device")
    tooltip = ["series:N", "devices:Q", alt.Tooltip("speedup:Q", format=".2f"), "reason:N"]

    def layer(part: pd.DataFrame) -> alt.Chart:
        return alt.Chart(part).encode(x=x, y=y, color=color, tooltip=tooltip)

    parts = [
        (coloured[coloured.series == "ideal (N x)"], lambda c: c.mark_line(strokeDash=[4, 4])),
        (coloured[coloured.series == TARGET], lambda c: c.mark_point(shape="diamond", size=90, filled=True)),
        (coloured[coloured.series.isin(PROJECTED)],
         lambda c: c.mark_line(strokeDash=[2, 3], point=alt.OverlayMarkDef(filled=False))),
        (coloured[coloured.series.isin(MEASURED)], lambda c: c.mark_line(point=alt.OverlayMarkDef(filled=True))),
    ]
    layers = [mark(layer(part)) for part, mark in parts if len(part)]
    if len(unreliable_rows):
        layers.append(alt.Chart(unreliable_rows).mark_point(filled=False, size=90, strokeWidth=2).encode(
            x=x, y=y, tooltip=tooltip, color=alt.value(UNRELIABLE_COLOR),
            shape=alt.Shape("series:N", legend=legend("Unreliable (hollow, grey)"))))
    return fit_width(alt.layer(*layers).resolve_scale(shape="independent").properties(title=title, height=300))


def efficiency_chart(rows: list[dict]) -> alt.Chart:
    """Bars: efficiency against ideal and against the ceiling, with the 80% floor; an unreliable
    device count's bars are hollow and grey, keyed by their dash. Only the layers with bars."""
    records = []
    for r in rows:
        ok = bool(r.get("reliable", True))
        mark = {"reliable": ok, "reason": None if ok else r.get("reason")}
        if r["efficiency"] is not None:
            records.append({"devices": str(r["devices"]), "efficiency": r["efficiency"],
                            "against": "ideal (N x)", **mark})
        if r.get("efficiency_vs_ceiling") is not None and r["devices"] > 1:
            records.append({"devices": str(r["devices"]), "efficiency": r["efficiency_vs_ceiling"],
                            "against": "ceiling (same processes, no communication)", **mark})
    data = pd.DataFrame.from_records(records, columns=["devices", "efficiency", "against", "reliable", "reason"])
    x = alt.X("devices:N", title="Devices", axis=alt.Axis(labelAngle=0))
    y = alt.Y("efficiency:Q", title="Efficiency", axis=alt.Axis(format="%"))
    tooltip = ["devices:N", "against:N", alt.Tooltip("efficiency:Q", format=".1%"), "reason:N"]
    solid, hollow = data[data.reliable], data[~data.reliable]
    layers = []
    if len(solid):
        layers.append(alt.Chart(solid).mark_bar().encode(
            x=x, xOffset="against:N", y=y, tooltip=tooltip, color=alt.Color("against:N", legend=legend("Against"))))
    if len(hollow):  # grey outlines; their dash tells ideal from ceiling
        # A field of its own for the dash, so that its key is not merged with the colours'.
        layers.append(alt.Chart(hollow.assign(unreliable=hollow.against)).mark_bar(
            filled=False, color=UNRELIABLE_COLOR, strokeWidth=2).encode(
            x=x, xOffset="against:N", y=y, tooltip=tooltip,
            strokeDash=alt.StrokeDash("unreliable:N", legend=legend("Unreliable (hollow, grey)"))))
    floor = alt.Chart(pd.DataFrame({"y": [scaling.TARGET_EFFICIENCY]})).mark_rule(
        color="#cf222e", strokeDash=[4, 4]).encode(y="y:Q")
    return fit_width(alt.layer(*layers, floor).properties(
        title=f"Efficiency (target over {scaling.TARGET_EFFICIENCY:.0%})", height=300))


# ---- heterogeneous runs ----------------------------------------------------------------------

def rank_time_chart(windows: list[dict], events: list[dict], field: str = "compute_time_s"
                    ) -> alt.LayerChart | None:
    """Each rank's `field` (compute_time_s or step_time_s, drawn in ms) against step, one line
    per rank with its share in the tooltip, the rebalances (and any loss of devices) as
    dashed rules, grouped into a few marks when dense (`charts.event_marks`). None without
    windows."""
    if field not in ("compute_time_s", "step_time_s"):
        raise ValueError(f"field must be compute_time_s or step_time_s, got {field!r}")
    if not windows:
        return None
    rows = _chart_rows(windows, field)
    x = step_x()
    line = alt.Chart(pd.DataFrame(rows)).mark_line(point=len(rows) <= 120).encode(
        x=x, y=value_y(units.RANK_TIME, "ms"), color=alt.Color("rank:N", title="Rank"),
        tooltip=[alt.Tooltip("rank:N", title="Rank"), alt.Tooltip("step:Q", title="Step", format=","),
                 alt.Tooltip("ms:Q", title="Time (ms)", format=units.RANK_TIME.value),
                 alt.Tooltip("share:N", title="Share (samples/step)")])
    marked = [e for e in events if e["kind"] in MARKED_EVENTS]
    title = "Compute time per rank" if field == "compute_time_s" else "Step time per rank"
    subtitle = events_subtitle(marked) or "no rebalance"
    return fit_width(alt.layer(line, *event_marks(marked)).properties(
        title=alt.TitleParams(title, subtitle=subtitle), height=CHART_HEIGHT))


def _chart_rows(windows: list[dict], field: str) -> list[dict[str, Any]]:
    """Long-form rows, each rank's series thinned so that the chart stays under the limit."""
    ranks = sorted({w["rank"] for w in windows})
    per_rank = points_per_series(len(ranks), MAX_ROWS_PER_CHART)
    rows = []
    for rank in ranks:
        series = [w for w in windows if w["rank"] == rank]
        label = f"{rank} ({series[-1]['device']})" if series[-1]["device"] else str(rank)
        for i in downsample_indices([w[field] for w in series], per_rank):
            w = series[i]
            rows.append({"step": w["step"], "rank": label, "ms": 1000 * w[field],
                         "share": MISSING if w["batch_size"] is None else f"{w['batch_size']:,}"})
    return rows

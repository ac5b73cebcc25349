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
from sae_dist.analytics.charts import CHART_HEIGHT, event_marks, events_subtitle, step_x, value_y
from sae_dist.analytics.downsample import MAX_ROWS_PER_CHART, downsample_indices, points_per_series
from sae_dist.bench import scaling
from sae_dist.format import MISSING

MARKED_EVENTS = ("rebalance", "degraded")  # the events that change who computes what

SERIES_ORDER = ["measured (DDP)", "ceiling (no communication)", "ideal (N x)", "target",
                "projected, no overlap", "projected, full overlap"]
SERIES_COLORS = ["#1f6feb", "#8250df", "#8c959f", "#cf222e", "#bf8700", "#1a7f37"]
UNRELIABLE_COLOR = "#8c959f"
MEASURED = ["measured (DDP)", "ceiling (no communication)"]
COLUMNS = ["devices", "speedup", "series", "reliable", "reason"]


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
            add(n, scaling.TARGET_SPEEDUP[n], "target")
    for p in projection or []:
        add(p["devices"], p["speedup_no_overlap"], "projected, no overlap")
        add(p["devices"], p["speedup_overlap"], "projected, full overlap")
    return pd.DataFrame.from_records(records, columns=COLUMNS)


def speedup_chart(rows: list[dict], projection: list[dict] | None = None, title: str = "Speedup") -> alt.Chart:
    data = speedup_frame(rows, projection)
    color = alt.Color("series:N", scale=alt.Scale(domain=SERIES_ORDER, range=SERIES_COLORS),
                      legend=alt.Legend(title=None, orient="right"))
    base = alt.Chart(data).encode(
        x=alt.X("devices:Q", title="Devices", scale=alt.Scale(nice=False), axis=alt.Axis(tickMinStep=1)),
        y=alt.Y("speedup:Q", title="Speedup over 1 device"), color=color,
        tooltip=["series:N", "devices:Q", alt.Tooltip("speedup:Q", format=".2f"), "reason:N"])
    measured_only = base.transform_filter(alt.FieldOneOfPredicate(field="series", oneOf=MEASURED))
    measured = measured_only.transform_filter(alt.datum.reliable).mark_line(point=alt.OverlayMarkDef(filled=True))
    unreliable = measured_only.transform_filter(~alt.datum.reliable).mark_point(
        filled=False, size=90, strokeWidth=2).encode(
        color=alt.value(UNRELIABLE_COLOR),  # a channel value: the series colour would win over the mark's
        shape=alt.Shape("series:N", legend=alt.Legend(title="Unreliable (hollow, grey)", orient="right")))
    ideal = base.transform_filter(alt.datum.series == "ideal (N x)").mark_line(strokeDash=[4, 4])
    target = base.transform_filter(alt.datum.series == "target").mark_point(shape="diamond", size=90, filled=True)
    projected = base.transform_filter(alt.FieldOneOfPredicate(
        field="series", oneOf=["projected, no overlap", "projected, full overlap"])).mark_line(
        strokeDash=[2, 3], point=alt.OverlayMarkDef(filled=False))
    return alt.layer(ideal, target, projected, measured, unreliable).properties(title=title, height=300)


def efficiency_chart(rows: list[dict]) -> alt.Chart:
    """Bars: efficiency against ideal and against the ceiling, with the 80% floor; an unreliable
    device count's bars are hollow and grey."""
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
    for rec in records:  # a field of its own, so its legend is not merged with the colours'
        rec["unreliable"] = None if rec["reliable"] else rec["against"]
    data = pd.DataFrame.from_records(records, columns=["devices", "efficiency", "against", "reliable", "reason",
                                                      "unreliable"])
    base = alt.Chart(data).encode(
        x=alt.X("devices:N", title="Devices", axis=alt.Axis(labelAngle=0)), xOffset="against:N",
        y=alt.Y("efficiency:Q", title="Efficiency", axis=alt.Axis(format="%")),
        tooltip=["devices:N", "against:N", alt.Tooltip("efficiency:Q", format=".1%"), "reason:N"])
    solid = base.transform_filter(alt.datum.reliable).mark_bar().encode(
        color=alt.Color("against:N", legend=alt.Legend(title="Against", orient="bottom")
                        if any(rec["reliable"] for rec in records) else None))
    # Grey outlines; their dash tells ideal from ceiling, with a legend of their own (the solid
    # bars' colour legend is empty when no count is reliable).
    hollow = base.transform_filter(~alt.datum.reliable).mark_bar(
        filled=False, color=UNRELIABLE_COLOR, strokeWidth=2).encode(
        strokeDash=alt.StrokeDash("unreliable:N",
                                  legend=alt.Legend(title="Unreliable (hollow, grey)", orient="bottom")))
    bars = alt.layer(solid, hollow)
    floor = alt.Chart(pd.DataFrame({"y": [scaling.TARGET_EFFICIENCY]})).mark_rule(
        color="#cf222e", strokeDash=[4, 4]).encode(y="y:Q")
    return alt.layer(bars, floor).properties(title=f"Efficiency (target over {scaling.TARGET_EFFICIENCY:.0%})",
                                             height=300)


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
    return alt.layer(line, *event_marks(marked)).properties(
        title=alt.TitleParams(title, subtitle=subtitle), height=CHART_HEIGHT)


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

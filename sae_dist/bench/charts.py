"""Altair charts of a benchmark, for the app's Benchmarks page and the HTML report.

Measured series are solid with points; the ideal line, the targets and the projection are
drawn apart (dashed or hollow) and say what they are in the legend: a projection is a model.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from sae_dist.bench import scaling

SERIES_ORDER = ["measured (DDP)", "ceiling (no communication)", "ideal (N x)", "target",
                "projected, no overlap", "projected, full overlap"]
SERIES_COLORS = ["#1f6feb", "#8250df", "#8c959f", "#cf222e", "#bf8700", "#1a7f37"]


def speedup_frame(rows: list[dict], projection: list[dict] | None = None) -> pd.DataFrame:
    """Long-form (devices, speedup, series) rows: measured, ceiling, ideal, targets, projection."""
    records = []
    counts = sorted({r["devices"] for r in rows} | {p["devices"] for p in projection or []} | {1})
    for r in rows:
        if r["speedup"] is not None:
            records.append({"devices": r["devices"], "speedup": r["speedup"], "series": "measured (DDP)"})
        if r.get("ceiling_speedup") is not None:
            records.append({"devices": r["devices"], "speedup": r["ceiling_speedup"],
                            "series": "ceiling (no communication)"})
    for n in counts:
        records.append({"devices": n, "speedup": float(n), "series": "ideal (N x)"})
        if n in scaling.TARGET_SPEEDUP:
            records.append({"devices": n, "speedup": scaling.TARGET_SPEEDUP[n], "series": "target"})
    for p in projection or []:
        records.append({"devices": p["devices"], "speedup": p["speedup_no_overlap"], "series": "projected, no overlap"})
        records.append({"devices": p["devices"], "speedup": p["speedup_overlap"], "series": "projected, full overlap"})
    return pd.DataFrame.from_records(records, columns=["devices", "speedup", "series"])


def speedup_chart(rows: list[dict], projection: list[dict] | None = None, title: str = "Speedup") -> alt.Chart:
    data = speedup_frame(rows, projection)
    color = alt.Color("series:N", scale=alt.Scale(domain=SERIES_ORDER, range=SERIES_COLORS),
                      legend=alt.Legend(title=None, orient="right"))
    base = alt.Chart(data).encode(
        x=alt.X("devices:Q", title="Devices", scale=alt.Scale(nice=False), axis=alt.Axis(tickMinStep=1)),
        y=alt.Y("speedup:Q", title="Speedup over 1 device"), color=color,
        tooltip=["series:N", "devices:Q", alt.Tooltip("speedup:Q", format=".2f")])
    measured = base.transform_filter(alt.FieldOneOfPredicate(
        field="series", oneOf=["measured (DDP)", "ceiling (no communication)"])).mark_line(point=True)
    ideal = base.transform_filter(alt.datum.series == "ideal (N x)").mark_line(strokeDash=[4, 4])
    target = base.transform_filter(alt.datum.series == "target").mark_point(shape="diamond", size=90, filled=True)
    projected = base.transform_filter(alt.FieldOneOfPredicate(
        field="series", oneOf=["projected, no overlap", "projected, full overlap"])).mark_line(
        strokeDash=[2, 3], point=alt.OverlayMarkDef(filled=False))
    return alt.layer(ideal, target, projected, measured).properties(title=title, height=300)


def efficiency_chart(rows: list[dict]) -> alt.Chart:
    """Bars: efficiency against ideal and against the ceiling, with the 80% floor."""
    records = []
    for r in rows:
        if r["efficiency"] is not None:
            records.append({"devices": str(r["devices"]), "efficiency": r["efficiency"], "against": "ideal (N x)"})
        if r.get("efficiency_vs_ceiling") is not None and r["devices"] > 1:
            records.append({"devices": str(r["devices"]), "efficiency": r["efficiency_vs_ceiling"],
                            "against": "ceiling (same processes, no communication)"})
    data = pd.DataFrame.from_records(records, columns=["devices", "efficiency", "against"])
    bars = alt.Chart(data).mark_bar().encode(
        x=alt.X("devices:N", title="Devices"), xOffset="against:N",
        y=alt.Y("efficiency:Q", title="Efficiency", axis=alt.Axis(format="%")),
        color=alt.Color("against:N", legend=alt.Legend(title="Against", orient="bottom")),
        tooltip=["devices:N", "against:N", alt.Tooltip("efficiency:Q", format=".1%")])
    floor = alt.Chart(pd.DataFrame({"y": [scaling.TARGET_EFFICIENCY]})).mark_rule(
        color="#cf222e", strokeDash=[4, 4]).encode(y="y:Q")
    return alt.layer(bars, floor).properties(title=f"Efficiency (target over {scaling.TARGET_EFFICIENCY:.0%})",
                                             height=300)

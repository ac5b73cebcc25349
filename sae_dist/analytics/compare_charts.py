"""Altair charts of the "Compare runs" view: one metric of several runs overlaid, and L0
against FVU over all runs with its Pareto frontier.

The rows come from `run_compare.overlay_frame` and `pareto`; titles and formats from `units`.
Every chart colours a run alike: one scale whose domain is the compared runs' labels in run id
order (`run_compare.color_scale`), so a run is the same colour in each chart and in the one key
the page shows above them (`run_compare.key_html`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import altair as alt
import pandas as pd

from sae_dist.analytics import units
from sae_dist.analytics.chart_stack import fit_width
from sae_dist.analytics.pareto import SELECTION
from sae_dist.analytics.run_compare import X_AXES, Overlay
from sae_dist.format import MISSING

CHART_HEIGHT = 240
RAW_OPACITY = 0.25  # the unsmoothed curve, faint beneath its smoothing
OTHER_RUN_COLOR = "#9e9e9e"  # runs on the Pareto chart that are not being compared
FRONTIER_COLOR = "#333333"


def compare_title(metric: str) -> str:
    """The chart's title: the metric's own (units.TRAINING) marked as a comparison, so it is
    never taken for the single run's chart of the same metric."""
    return f"{units.training_unit(metric).title} · runs compared"


def empty_text(overlay: Overlay, metric: str) -> str:
    """What the page says in place of a chart `overlay_chart` did not draw: measured values a
    log scale cannot draw are not "not measured"."""
    if overlay.hidden:
        return (f"{compare_title(metric)}: every measured value is 0 or below, which a log "
                "scale cannot draw")
    return f"{compare_title(metric)}: not measured ({MISSING})"


def _x(x: str) -> alt.X:
    axis = X_AXES[x]
    return alt.X("x:Q", title=axis.title, axis=alt.Axis(format=axis.format, labelOverlap=True),
                 scale=alt.Scale(zero=False, nice=False))


def _y(unit: units.Unit, field: str, log: bool) -> alt.Y:
    scale = alt.Scale(type="log") if log else alt.Scale(zero=False)
    return alt.Y(f"{field}:Q", title=unit.axis_title, scale=scale, axis=alt.Axis(format=unit.axis))


def _subtitle(smoothed: bool, weight: float, log: bool, hidden: int) -> str | None:
    parts = []
    if smoothed:
        parts.append(f"smoothed (EMA {weight:g}, debiased); faint: raw")
    if log:
        parts.append("log scale" + (f"; {hidden:,} points ≤ 0 not drawn" if hidden else ""))
    return " · ".join(parts) or None


def overlay_chart(overlay: Overlay, metric: str, x: str, colors: tuple[list[str], list[str]],
                  weight: float = 0.0, log: bool = False) -> alt.LayerChart | alt.Chart | None:
    """`metric` of each compared run against `x`, one colour per run (`colors`: the scale's
    domain and range); with `weight` > 0 the smoothed curve over the faint raw one. None when
    no compared run measured the metric."""
    data = overlay.frame
    if not len(data) or not data["raw"].notna().any():
        return None
    unit = units.training_unit(metric)
    domain, palette = colors
    # No legend on each chart: the page draws one key above them all (`run_compare.key_html`).
    color = alt.Color("label:N", title="Run", scale=alt.Scale(domain=domain, range=palette),
                      legend=None)
    smoothed = weight > 0
    tooltip = [alt.Tooltip("label:N", title="Run"), alt.Tooltip("step:Q", title="Step", format=",")]
    if x != "step":  # against step, x is the step already shown
        tooltip.append(alt.Tooltip("x:Q", title=X_AXES[x].title, format=X_AXES[x].format))
    tooltip.append(alt.Tooltip("raw:Q", title=unit.title, format=unit.value))
    if smoothed:
        tooltip.append(alt.Tooltip("smoothed:Q", title="Smoothed", format=unit.value))
    base = alt.Chart(data).encode(x=_x(x), color=color, detail="label:N")
    raw = base.mark_line(opacity=RAW_OPACITY if smoothed else 1.0, interpolate="linear").encode(
        y=_y(unit, "raw", log), tooltip=tooltip)
    layers = [raw]
    if smoothed:
        layers.append(base.mark_line(interpolate="linear").encode(
            y=_y(unit, "smoothed", log), tooltip=tooltip))
    subtitle = _subtitle(smoothed, weight, log, overlay.hidden)
    title = alt.TitleParams(compare_title(metric), subtitle=subtitle) if subtitle else compare_title(metric)
    chart = layers[0] if len(layers) == 1 else alt.layer(*layers)
    return chart.properties(title=title, height=CHART_HEIGHT)


def pareto_chart(points: Sequence[dict[str, Any]], frontier: Sequence[dict[str, Any]],
                 colors: dict[int, str]) -> alt.LayerChart | None:
    """Each run's final L0 (x) and FVU (y), coloured as in the other charts where compared and
    grey otherwise, shaped by where it was measured; the frontier as a staircase line (the best
    FVU reached at each L0). Clicking a point selects its run (selection SELECTION on "run").
    None without points."""
    if not points:
        return None
    data = pd.DataFrame([{**p, "color": colors.get(p["run"], OTHER_RUN_COLOR),
                          "label": f"{p['run']} · {p['name']}"} for p in points])
    l0_unit, fvu_unit = units.training_unit("l0"), units.training_unit("fvu")
    x = alt.X("l0:Q", title="L0 (active latents per sample)", scale=alt.Scale(zero=False),
              axis=alt.Axis(format=l0_unit.axis))
    y = alt.Y("fvu:Q", title="FVU", scale=alt.Scale(zero=False), axis=alt.Axis(format=fvu_unit.axis))
    pick = alt.selection_point(name=SELECTION, fields=["run"], on="click", empty=False)
    dots = alt.Chart(data).mark_point(size=90, filled=True, opacity=0.9).encode(
        x=x, y=y, color=alt.Color("color:N", scale=None),
        shape=alt.Shape("source:N", title="Measured on", legend=alt.Legend(orient="bottom")),
        strokeWidth=alt.condition(pick, alt.value(3), alt.value(0)),
        tooltip=[alt.Tooltip("label:N", title="Run"), alt.Tooltip("status:N", title="Status"),
                 alt.Tooltip("l0:Q", title="L0", format=l0_unit.value),
                 alt.Tooltip("fvu:Q", title="FVU", format=fvu_unit.value),
                 alt.Tooltip("measured_on:N", title="Measured on")],
    ).add_params(pick)
    line = alt.Chart(pd.DataFrame([{"l0": p["l0"], "fvu": p["fvu"]} for p in frontier])).mark_line(
        interpolate="step-after", color=FRONTIER_COLOR, strokeDash=[4, 3], opacity=0.7,
    ).encode(x=x, y=y)
    title = alt.TitleParams("L0 against FVU, every run",
                            subtitle="lower left is better · dashed: the Pareto frontier · "
                                     "click a point to open its run")
    return fit_width(alt.layer(line, dots).properties(title=title, height=320))

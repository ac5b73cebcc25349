"""A sweep's SAEs' curves overlaid, each column of charts one Vega view with its Vega-Lite spec
written directly, shaped for what the browser pays per point.

The Training runs page's overlays (`run_compare.overlay_frame` + `compare_charts`) give each
chart six columns a row (run, label, step, x, raw, smoothed) and Vega-Lite's defaults: for 16
SAEs of 200 logged steps that is 96,000 cells the browser turns from Arrow into objects one by
one, then per point an ARIA description built with three number formats, a validity test
and a `toNumber`, each run through Vega's expression interpreter (Streamlit's CSP-safe mode).
That was most of the Sweeps page's 3 s in Chromium. A sweep draws against step, unsmoothed, on
a linear scale, so a chart's rows are the SAE's label, the step and the metric
(`metric_rows`), at most `ROWS_PER_CHART` of them (each SAE's share kept by the one
downsampling rule: the min and max of each bin, `downsample`), and its spec asks for nothing
per point but the tooltip naming the SAE (`metric_spec`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import altair as alt
import pandas as pd

from sae_dist import format as fmt
from sae_dist.analytics import units
from sae_dist.analytics.chart_stack import AUTOSIZE, CONTAINER_WIDTH, SPACING
from sae_dist.analytics.compare_charts import CHART_HEIGHT, compare_title
from sae_dist.analytics.downsample import downsample_indices, is_missing, points_per_series
from sae_dist.analytics.monitor_views import View
from sae_dist.analytics.run_compare import X_AXES, run_label

ROWS_PER_CHART = 1_600
"""Rows one chart ships at most (all its SAEs): 100 points a curve for 16 SAEs, 200 for 8.
With 3,200 (every logged step of the bench's sweep) the page took 2.5 s in Chromium, with
1,600 about 1 s; min and max of each bin keep the curves' shape at a chart's width."""


def metric_rows(series: Sequence[tuple[dict[str, Any], dict[str, list]]], metric: str,
                max_rows: int = ROWS_PER_CHART) -> pd.DataFrame:
    """One chart's rows: "label" (`run_label`), "step" and `metric` for each SAE's points
    its downsampling kept (min and max of each bin, at most its share of `max_rows`).
    Only measured, finite values: the chart needs no filter of its own."""
    per_run = points_per_series(max(len(series), 1), max_rows)
    labels, steps, values = [], [], []
    for run, columns in series:
        raw = [v if not is_missing(v) and math.isfinite(v) else None for v in columns.get(metric, [])]
        keep = downsample_indices(raw, per_run)
        labels += [run_label(run)] * len(keep)
        steps += [columns["step"][i] for i in keep]
        values += [float(raw[i]) for i in keep]
    return pd.DataFrame({"label": pd.Series(labels, dtype="object"), "step": pd.Series(steps, dtype="int64"),
                         metric: pd.Series(values, dtype="float64")})


def metric_spec(metric: str, colors: tuple[list[str], list[str]]) -> dict[str, Any]:
    """One chart of the column: `metric` of each SAE against step, one line and colour per SAE
    (`colors`: the scale's domain and range, as on every chart of the page), hover naming it."""
    unit = units.training_unit(metric)
    domain, palette = colors
    step = X_AXES["step"]
    return {
        "title": compare_title(metric), "height": CHART_HEIGHT,
        # Per point, Vega runs each expression through its interpreter: one validity filter
        # (not a test per channel each redraw) and no ARIA description (the alt text says it).
        "mark": {"type": "line", "interpolate": "linear", "invalid": "filter", "aria": False},
        "encoding": {
            "x": {"field": "step", "type": "quantitative", "title": step.title,
                  "axis": {"format": step.format, "labelOverlap": True}, "scale": {"zero": False, "nice": False}},
            "y": {"field": metric, "type": "quantitative", "title": unit.axis_title,
                  "axis": {"format": unit.axis}, "scale": {"zero": False}},
            "color": {"field": "label", "type": "nominal", "title": "Run", "legend": None,
                      "scale": {"domain": list(domain), "range": list(palette)}},
            "detail": {"field": "label", "type": "nominal"},
            "tooltip": [{"field": "label", "type": "nominal", "title": "Run"},
                        {"field": "step", "type": "quantitative", "title": "Step", "format": ","},
                        {"field": metric, "type": "quantitative", "title": unit.title, "format": unit.value}]},
    }


def column_view(frames: dict[str, pd.DataFrame], metrics: Sequence[str],
                colors: tuple[list[str], list[str]]) -> View:
    """The charts of `metrics` (each with its rows in `frames`) one above another in one view;
    in words, each metric no SAE measured."""
    drawn = [m for m in metrics if len(frames[m])]
    missing = [f"{compare_title(m)}: not measured ({fmt.MISSING})" for m in metrics if m not in drawn]
    alt_text = "; ".join(f"{compare_title(m)} against step" for m in drawn)
    if not drawn:
        return View(None, alt_text, missing)
    data = {m: frames[m] for m in drawn}
    # parse: null, no per-row toNumber: the frames' columns are typed already.
    charts = [{**metric_spec(m, colors), "data": {"name": m, "format": {"parse": None}}} for m in drawn]
    if len(charts) == 1:
        return View({"$schema": alt.SCHEMA_URL, **charts[0], "datasets": data}, alt_text, missing)
    # As `chart_stack.stack_spec` writes a column: one concat whose charts share the column's width.
    return View({"$schema": alt.SCHEMA_URL, "concat": charts, "columns": 1, "spacing": SPACING,
                 "resolve": {"scale": {"x": "independent", "y": "independent"}},
                 "params": [{"name": "width", "expr": CONTAINER_WIDTH}], "autosize": dict(AUTOSIZE),
                 "datasets": data}, alt_text, missing)


def curve_views(series: Sequence[tuple[dict[str, Any], dict[str, list]]], metrics: Sequence[str],
                colors: tuple[list[str], list[str]], columns: int = 2,
                max_rows: int = ROWS_PER_CHART) -> list[View]:
    """The overlaid curves of `metrics`, read left to right then down in `columns` columns,
    each column one view."""
    frames = {metric: metric_rows(series, metric, max_rows) for metric in metrics}
    return [column_view(frames, metrics[i::columns], colors) for i in range(columns)]

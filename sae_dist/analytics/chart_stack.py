"""Several charts sent to the browser as one Vega view: a page section's charts stacked.

The browser draws every chart element as a Vega view of its own (parse the spec, build its
dataflow, render, observe its size): 0.15-0.25 s a view on a loaded machine, and the
Monitor drew twelve. A vertical concatenation of a column's charts is one view whatever it
holds, and each chart in it keeps its own title, axes, scales, tooltips, marks and data.

The charts take the column's width, which the server does not know: Streamlit 1.67
stretches a `vconcat` only when no chart in it is layered (ours have bands, totals, event
marks), so the stack is a one-column `concat` whose shared width is the browser's container
width (`containerSize()`, read when the view is built: Streamlit builds a concatenated view
anew when its column's width changes), with the axes fitted inside it (autosize fit-x).

`stack_spec` writes that view as a Vega-Lite dict without Altair's composition: Altair's
`concat` deep-copies every chart, and its `to_dict` validates the whole spec against the
schema; together they took 0.5 s of the Monitor's 1 s script run (the bench database). Each
chart's own `to_dict` (unvalidated: the builders' output is checked by tests) is all that
is left. Its datasets are named by their place in the view ("data-0", ...), not by their
content: when a live page redraws with new rows and the same spec, Streamlit swaps the rows
into the view it has rather than building a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import altair as alt
import pandas as pd

SPACING = 28  # px between two stacked charts: room for the lower one's title and subtitle
CONTAINER_WIDTH = "isFinite(containerSize()[0]) && containerSize()[0] > 0 ? containerSize()[0] : 400"
AUTOSIZE = {"type": "fit-x", "contains": "padding"}
COMPOSITIONS = ("layer", "concat", "vconcat", "hconcat")
TOP_LEVEL_ONLY = ("$schema", "autosize", "padding", "background", "datasets")


def stack(charts: Sequence[alt.TopLevelMixin | None], spacing: int = SPACING
          ) -> alt.TopLevelMixin | None:
    """The charts (None ones left out: nothing measured, nothing drawn) one above another as
    a single view, each with its own x and y scales; a lone chart stays as it is; None when
    none is left."""
    present = [chart for chart in charts if chart is not None]
    if len(present) <= 1:
        return present[0] if present else None
    # A param named "width" is the shared width signal of a one-column concat's charts.
    return fit_width(alt.concat(*present, columns=1, spacing=spacing).resolve_scale(
        x="independent", y="independent").add_params(alt.param(name="width", expr=CONTAINER_WIDTH)))


def fit_width(chart: alt.TopLevelMixin) -> alt.TopLevelMixin:
    """A chart (or a stack) that fits the container's width only, its height its own: under
    Streamlit's default "fit" a legend below the plot is taken out of the plot's height (the
    L0-FVU chart's 320 px plot drew about 100 px tall, a speedup chart's 300 px one 80 px)."""
    return chart.properties(autosize=alt.AutoSizeParams(type=AUTOSIZE["type"], contains=AUTOSIZE["contains"]))


# No ARIA description per mark: Vega builds one per point (three number formats, through its
# expression interpreter in Streamlit's CSP-safe mode), a large share of a chart's drawing time;
# each view's alt text says what it shows.
NO_ARIA = {"aria": False}


def stack_spec(charts: Sequence[alt.TopLevelMixin | None], spacing: int = SPACING
               ) -> dict[str, Any] | None:
    """`stack(charts).to_dict()` built cheaply: the Vega-Lite spec of the charts (None ones
    left out) one above another, or of the lone chart, with its rows as data frames under
    `datasets` (the form `st.vega_lite_chart` takes); None when no chart is left."""
    present = [chart for chart in charts if chart is not None]
    if not present:
        return None
    datasets: dict[str, pd.DataFrame] = {}
    specs = [_unit_spec(chart, datasets) for chart in present]
    if any("params" in spec for spec in specs):  # selections must be lifted: Altair's way
        view = stack(present, spacing)
        return view.to_dict() if view is not None else None
    if len(specs) == 1:  # fit-x as a stack's: Streamlit's default "fit" cuts off a legend taller than the chart
        config = {**specs[0].get("config", {}), **NO_ARIA}
        return {"$schema": alt.SCHEMA_URL, **specs[0], "autosize": dict(AUTOSIZE), "config": config,
                "datasets": datasets}
    return {"$schema": alt.SCHEMA_URL, "concat": specs, "columns": 1, "spacing": spacing,
            "resolve": {"scale": {"x": "independent", "y": "independent"}},
            "params": [{"name": "width", "expr": CONTAINER_WIDTH}],
            "autosize": dict(AUTOSIZE), "config": dict(NO_ARIA), "datasets": datasets}


def _unit_spec(chart: alt.TopLevelMixin, datasets: dict[str, pd.DataFrame]) -> dict[str, Any]:
    """One chart's spec, its data frames named into `datasets` (a frame several layers share
    is one dataset), without the keys only a top-level spec may hold."""
    spec = _named_data(chart, datasets, {}).to_dict(validate=False)
    for key in TOP_LEVEL_ONLY:
        spec.pop(key, None)
    if chart._get("config") is alt.Undefined:  # Altair's theme's, which Streamlit turns off
        spec.pop("config", None)
    return spec


def _named_data(chart: Any, datasets: dict[str, pd.DataFrame], names: dict[int, str]) -> Any:
    """A shallow copy of `chart` (and of its layers) whose data frames are references to
    named datasets; the chart itself is left as it was."""
    copy = chart.copy(deep=False)
    data = chart._get("data")
    if isinstance(data, pd.DataFrame):
        name = names.get(id(data))
        if name is None:
            name = names[id(data)] = f"data-{len(datasets)}"
            datasets[name] = data
        copy.data = alt.NamedData(name=name)
    for key in COMPOSITIONS:
        parts = chart._get(key)
        if isinstance(parts, list):
            copy[key] = [_named_data(part, datasets, names) for part in parts]
    return copy

"""The charts a page drew, read back from AppTest. A Streamlit chart element is one Vega view,
and a view may stack several charts (`sae_dist.analytics.chart_stack`: a one-column concat),
so tests look at the charts themselves: each one's title, its layers (mark, encodings) and
the rows each layer plots, in page order."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df

COMPOSITIONS = ("vconcat", "hconcat", "concat")


@dataclass
class SubChart:
    title: str | None
    spec: dict  # the chart's own spec: a unit or a layer
    layers: list[tuple[dict, Any]]  # each layer with the data frame it plots
    frames: dict[str, Any]  # every dataset of the view it sits in, by name


def sub_charts(element) -> list[SubChart]:
    """The charts of one chart element (a lone chart, or each chart of a concatenation)."""
    spec = json.loads(element.proto.spec)
    frames = {d.name: convert_arrow_bytes_to_pandas_df(d.data.data) for d in element.proto.datasets}
    found: list[SubChart] = []

    def visit(view: dict, data: dict | None) -> None:
        data = view.get("data", data)
        for key in COMPOSITIONS:
            if key in view:
                for child in view[key]:
                    visit(child, data)
                return
        title = view.get("title")
        title = title.get("text") if isinstance(title, dict) else title
        layers = [(layer, frames[(layer.get("data") or data)["name"]])
                  for layer in view.get("layer", [view])]
        found.append(SubChart(title, view, layers, frames))

    visit(spec, None)
    return found


def page_charts(at) -> list[SubChart]:
    """Every chart on the page, in page order, whichever view it was sent in."""
    return [chart for element in at.get("vega_lite_chart") for chart in sub_charts(element)]

"""Several charts sent to the browser as one Vega view: a page section's charts stacked.

The browser draws every `st.altair_chart` as a Vega view of its own (parse the spec, build
its dataflow, render, observe its size): 0.15-0.25 s a view on a loaded machine, and the
Monitor drew twelve. A vertical concatenation of a column's charts is one view whatever it
holds, and each chart in it keeps its own title, axes, scales, tooltips, marks and data.

The charts take the column's width, which the server does not know: Streamlit 1.67
stretches a `vconcat` only when no chart in it is layered (ours have bands, totals, event
marks), so the stack is a one-column `concat` whose shared width is the browser's container
width (`containerSize()`, read when the view is built: Streamlit builds a concatenated view
anew when its column's width changes), with the axes fitted inside it (autosize fit-x).
"""

from __future__ import annotations

from collections.abc import Sequence

import altair as alt

SPACING = 28  # px between two stacked charts: room for the lower one's title and subtitle
CONTAINER_WIDTH = "isFinite(containerSize()[0]) && containerSize()[0] > 0 ? containerSize()[0] : 400"


def stack(charts: Sequence[alt.TopLevelMixin | None], spacing: int = SPACING
          ) -> alt.TopLevelMixin | None:
    """The charts (None ones left out: nothing measured, nothing drawn) one above another as
    a single view, each with its own x and y scales; a lone chart stays as it is; None when
    none is left."""
    present = [chart for chart in charts if chart is not None]
    if len(present) <= 1:
        return present[0] if present else None
    # A param named "width" is the shared width signal of a one-column concat's charts.
    return alt.concat(*present, columns=1, spacing=spacing).resolve_scale(
        x="independent", y="independent").add_params(
        alt.param(name="width", expr=CONTAINER_WIDTH)).properties(
        autosize=alt.AutoSizeParams(type="fit-x", contains="padding"))

"""The Monitor's per-GPU sparklines: a device series as a small chart with a time axis (24-hour
UTC clock times, `time_axis`), where Streamlit's own metric sparkline has none and so cannot
say when a spike happened. Values stay off the chart's axes: the card above it says the last
one, read by the same rule (`cards.sparkline_text`: the last measured point).
"""

from __future__ import annotations

import altair as alt

from sae_dist.analytics import units
from sae_dist.analytics.charts import device_frame
from sae_dist.analytics.time_axis import time_tooltip, time_x

HEIGHT = 120  # the whole chart, time axis included: Streamlit fits the plot inside it
AREA_FIELDS = ("memory_used", "utilization_pct")  # a share of something: filled to zero


def sparkline_chart(columns: dict[str, list], field: str, width_s: int) -> alt.Chart | None:
    """`field` of one device (`samples.Series.columns`) against time, in its plotted unit,
    breaking where readings stopped (`charts.device_frame`); None when nothing was measured
    (a virtual device's power)."""
    unit = units.DEVICE[field]
    data = device_frame(columns, field, width_s)[["time", "value"]]
    if not data["value"].notna().any():
        return None
    mark = (alt.Chart(data).mark_area(line=True, opacity=0.3, invalid=None) if field in AREA_FIELDS
            else alt.Chart(data).mark_line(invalid=None, point=len(data) <= 2))
    scale = (alt.Scale(domain=[0, 100]) if field == "utilization_pct"
             else alt.Scale(zero=field in AREA_FIELDS))
    y = alt.Y("value:Q", axis=None, title=unit.axis_title, scale=scale)
    return mark.encode(
        x=time_x(data["time"], tick_count=3), y=y,
        tooltip=[time_tooltip(),
                 alt.Tooltip("value:Q", title=f"{unit.title} ({unit.axis_title})", format=unit.value)],
    ).properties(height=HEIGHT)

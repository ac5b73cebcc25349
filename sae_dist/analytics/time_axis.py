"""The time axis of every chart against time: 24-hour clock times in UTC, titled so.

Vega's default labels are 12-hour without AM/PM ("07:21" for 19:21) and in the browser's
zone, beside timestamps the app writes in UTC. Here the scale is UTC, and Vega formats an
axis on a UTC scale in UTC, so no browser zone shifts the labels; a chart spanning more than a
day puts the date in its labels. No `formatType="utc"` anywhere: Vega-Lite 6.4 then drops an
axis's format altogether (the labels fell back to "07:20"; tests/test_time_axes.py draws them)
and writes a tooltip as `utc(time, format)`, Vega's date-from-parts function, not a format. A
tooltip gets a UTC time unit instead (formatted with `utcFormat`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Iterable

import altair as alt

TITLE = "time (UTC)"
CLOCK = "%H:%M"
SECONDS = "%H:%M:%S"
DATED = "%b %d, %H:%M"
DAY = timedelta(days=1)
# Vega (d3) spaces time ticks by the nice interval nearest span / tick count: below ~42 s it
# picks 30 s or less, and "%H:%M" would repeat one minute under several ticks.
SUB_MINUTE_TICKS = timedelta(seconds=42)


def label_format(times: Iterable[datetime | None], tick_count: int = 5) -> str:
    """"%H:%M" for times within a day of each other (the clock time is unambiguous); with the
    seconds when the ticks come closer than a minute (a short span); with the date when the
    span is longer than a day."""
    present = [t for t in times if t is not None and t == t]  # NaT is not equal to itself
    span = max(present) - min(present) if len(present) > 1 else timedelta(0)
    if span > DAY:
        return DATED
    if timedelta(0) < span / tick_count < SUB_MINUTE_TICKS:
        return SECONDS
    return CLOCK


def time_x(times: Iterable[datetime | None] = (), field: str = "time", *, title: str | None = TITLE,
           tick_count: int = 5) -> alt.X:
    """The x encoding of `field` (timezone-aware datetimes) on a UTC scale with 24-hour UTC
    labels; `times` (the plotted ones) choose whether the labels need the date."""
    return alt.X(f"{field}:T", title=title, scale=alt.Scale(type="utc"),
                 axis=alt.Axis(format=label_format(times, tick_count), labelOverlap=True,
                               tickCount=tick_count))


def time_tooltip(field: str = "time", title: str = "Time (UTC)") -> alt.Tooltip:
    """A tooltip of `field` as "2026-11-24 19:20:05", in UTC (a UTC time unit down to the
    second: Vega-Lite formats it with utcFormat)."""
    return alt.Tooltip(f"utcyearmonthdatehoursminutesseconds({field}):T", title=title,
                       format="%Y-%m-%d %H:%M:%S")

"""Thin a long series for a chart without lying about it.

A browser slows down past about 2,000 points a series, and a long run logs far more steps.
Averaging bins would hide the spikes people look for (a loss blow-up, a straggler), so the
default keeps, from each bin, the actual points holding the bin's minimum and maximum
(at their real steps); "last" keeps each bin's last point, for smooth or monotone series.
The first and last points of a series are always kept, so a chart starts and ends where
the run did. Missing values (None, NaN) are never plotted and never replaced by a number.

Pure functions on plain sequences: the page does the I/O, these decide what is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

MAX_POINTS_PER_SERIES = 2_000
"""Default cap of points per series sent to the browser."""

MAX_ROWS_PER_CHART = 4_000
"""Cap of rows per chart (all its series): below Altair's 5,000-row `to_dict()` limit."""

Keep = Literal["minmax", "last"]


def is_missing(value: float | None) -> bool:
    """True for None and NaN: a value that was not measured (or diverged) and is not drawn."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def downsample_indices(values: Sequence[float | None], max_points: int = MAX_POINTS_PER_SERIES,
                       keep: Keep = "minmax") -> list[int]:
    """Indices (ascending) of the points of `values` to draw: at most `max_points` of them.

    `values` are in step order. Missing values are dropped first; if what is left fits, all
    of it is kept. Otherwise the present points are cut into equal-count bins (integer
    arithmetic) and each bin gives its min and max points ("minmax") or its last ("last").
    """
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    if keep not in ("minmax", "last"):
        raise ValueError(f"keep must be 'minmax' or 'last', got {keep!r}")
    present = [i for i, v in enumerate(values) if not is_missing(v)]
    n = len(present)
    if n <= max_points:
        return present
    # The first and last points are kept outside the bins: two of the budget.
    inner = present[1:-1]
    per_bin = 2 if keep == "minmax" else 1
    bins = (max_points - 2) // per_bin
    m = len(inner)
    chosen = {present[0], present[-1]}
    for b in range(bins):
        lo, hi = b * m // bins, (b + 1) * m // bins
        if lo == hi:
            continue
        members = inner[lo:hi]
        if keep == "last":
            chosen.add(members[-1])
        else:
            chosen.add(min(members, key=lambda i: values[i]))
            chosen.add(max(members, key=lambda i: values[i]))
    return sorted(chosen)


def downsample(steps: Sequence[int], values: Sequence[float | None],
               max_points: int = MAX_POINTS_PER_SERIES,
               keep: Keep = "minmax") -> tuple[list[int], list[float]]:
    """The (steps, values) to draw for one series: real points only, at most `max_points`."""
    if len(steps) != len(values):
        raise ValueError(f"{len(steps)} steps but {len(values)} values")
    idx = downsample_indices(values, max_points, keep)
    return [steps[i] for i in idx], [float(values[i]) for i in idx]


def points_per_series(n_series: int, max_rows: int = MAX_ROWS_PER_CHART,
                      max_points: int = MAX_POINTS_PER_SERIES) -> int:
    """The per-series cap that keeps a chart of `n_series` series within `max_rows` rows."""
    return max(4, min(max_points, max_rows // max(n_series, 1)))

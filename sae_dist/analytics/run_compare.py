"""Several training runs side by side (the Training runs page's "Compare runs" view): which run
opens first, each run's colour, the x axis, and the rows one overlaid chart draws.

Pure functions of plain data (`queries.list_runs` summaries, `queries.run_step_metrics`
columns); `compare_charts` draws the rows. Smoothing is TensorBoard's (`smoothing`), computed on
the whole series before it is thinned by the one downsampling rule (`downsample`), so the
smoothed line does not depend on which points were kept.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd

from sae_dist.analytics.downsample import downsample_indices, is_missing, points_per_series
from sae_dist.analytics.smoothing import ema_debiased

COMPARE_METRICS = ("loss", "fvu", "l0", "dead_fraction", "samples_per_s", "lr")
"""The overlaid curves, in display order. Throughput is samples/s: the one rate step_metrics
holds (a sample is one activation vector, so one token for a language model's activations)."""
# Rows an overlaid chart ships: a chart is half the page wide (about 420 px at 1,400 px), so one
# run gets 1,000 (the min and max of 500 bins, as Training runs draws a run alone) and runs share
# 1,600 (as a sweep's curves). With 2,000 a run, the Compare tab of one 200,000-step run took
# 0.93 s to its last chart drawn in Chromium, with these 0.84 s (scripts/bench_app.py's data).
OVERLAY_ROWS = 1_600
OVERLAY_POINTS_PER_RUN = 1_000

STEP_COLUMNS = ("step", "samples_seen", "time", *COMPARE_METRICS)
"""The step_metrics columns the view reads for each run."""

# Tableau 10: distinct for the first ten runs; more runs reuse them in order.
PALETTE = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b",
           "#eeca3b", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")


@dataclass(frozen=True)
class XAxis:
    """What a curve is drawn against: the axis title and its d3 tick format."""

    title: str
    format: str


X_AXES = {
    "step": XAxis("Step", ",d"),
    "samples": XAxis("Samples seen", "~s"),
    "wall": XAxis("Seconds since the run started", ",~r"),
}
"""The x axis choices by key, in the page's order."""


def has_steps(run: dict[str, Any]) -> bool:
    """Whether the run logged at least one step (its summary has the time of the latest)."""
    return run.get("last_update") is not None


def default_run(runs: Sequence[dict[str, Any]]) -> int | None:
    """The run the page opens on: the newest (highest id) that logged a step, else the newest
    (an empty, cancelled run is never preferred to one with curves); None without runs."""
    if not runs:
        return None
    with_steps = [r["id"] for r in runs if has_steps(r)]
    return max(with_steps) if with_steps else max(r["id"] for r in runs)


def compare_default(runs: Sequence[dict[str, Any]], opened: int | None) -> list[int]:
    """The runs compared first: the run open on the page if it logged steps, else the newest
    that did (`default_run`)."""
    by_id = {r["id"]: r for r in runs}
    if opened in by_id and has_steps(by_id[opened]):
        return [opened]
    first = default_run(runs)
    return [] if first is None else [first]


def runs_in_link(text: str, known: Sequence[int]) -> list[int]:
    """The runs a shared link names (`?compare=3,5`), in its order, those that exist only: a
    comparison to bookmark or send. Anything else in it is ignored, as a stale link's gone runs."""
    named = []
    for part in text.split(","):
        part = part.strip()
        if part.isascii() and part.isdigit() and int(part) in known and int(part) not in named:
            named.append(int(part))
    return named


def link_value(picked: Sequence[int]) -> str:
    """The compared runs as the link says them (`runs_in_link` reads it back)."""
    return ",".join(str(i) for i in picked)


def run_label(run: dict[str, Any]) -> str:
    """A run in legends and tables: "12 · name" (the id keeps runs of one name apart)."""
    return f"{run['id']} · {run['name']}"


def run_colors(run_ids: Sequence[int], palette: Sequence[str] = PALETTE) -> dict[int, str]:
    """Each compared run's colour, the same on every chart: the palette in order of run id
    (not of selection), so a run keeps its colour when runs are added after it."""
    return {run_id: palette[i % len(palette)] for i, run_id in enumerate(sorted(set(run_ids)))}


def color_scale(runs: Sequence[dict[str, Any]],
                colors: dict[int, str] | None = None) -> tuple[list[str], list[str]]:
    """The (domain, range) of the runs' colour scale: labels in run id order and their colours
    (`colors` by run id when the page chose them, else `run_colors` of these runs)."""
    colors = colors if colors is not None else run_colors([r["id"] for r in runs])
    ordered = sorted(runs, key=lambda r: r["id"])
    return [run_label(r) for r in ordered], [colors[r["id"]] for r in ordered]


def key_html(runs: Sequence[dict[str, Any]], colors: dict[int, str] | None = None) -> str:
    """The one colour key of the compared runs' charts, in run id order: a swatch in the run's
    colour and its label (names escaped: a run's name is the user's text)."""
    domain, palette = color_scale(runs, colors)
    return " &nbsp; ".join(f'<span style="color:{color}">&#9632;</span> {html.escape(label)}'
                           for label, color in zip(domain, palette))


def x_values(columns: dict[str, list], x: str, started_at: datetime | None) -> list[Any]:
    """The x of each logged step: its step, its samples seen, or the seconds from
    `started_at` to the step's time (None where that time is unknown)."""
    if x == "step":
        return list(columns["step"])
    if x == "samples":
        return list(columns["samples_seen"])
    if x == "wall":
        return [None if t is None or started_at is None else (t - started_at).total_seconds()
                for t in columns["time"]]
    raise ValueError(f"x must be one of {', '.join(X_AXES)}, got {x!r}")


def log_visible(values: Sequence[float | None], log: bool) -> list[float | None]:
    """Values a log axis can draw: on a log scale, zero and negatives become missing."""
    if not log:
        return list(values)
    return [None if is_missing(v) or v <= 0 else v for v in values]


@dataclass
class Overlay:
    """The rows of one overlaid chart (run, label, step, x, raw, smoothed) and how many
    measured points a log scale could not draw."""

    frame: pd.DataFrame
    hidden: int


def overlay_frame(series: Sequence[tuple[dict[str, Any], dict[str, list]]], metric: str, x: str,
                  weight: float, log: bool) -> Overlay:
    """One metric of each (run summary, step columns) pair against `x`: the raw values and
    their smoothing (`weight`, TensorBoard's), each run thinned to its share of the chart's
    rows by `downsample_indices` (min and max of each bin of the raw series)."""
    per_run = points_per_series(max(len(series), 1), OVERLAY_ROWS, OVERLAY_POINTS_PER_RUN)
    parts, hidden = [], 0
    for run, columns in series:
        raw = columns.get(metric, [])
        smooth = log_visible(ema_debiased(raw, weight), log)
        shown = log_visible(raw, log)
        hidden += sum(1 for r, s in zip(raw, shown) if not is_missing(r) and s is None)
        xs = x_values(columns, x, run.get("started_at"))
        drawable = [None if xs[i] is None else v for i, v in enumerate(shown)]
        keep = downsample_indices(drawable, per_run)
        parts.append(pd.DataFrame({
            "run": pd.array([run["id"]] * len(keep), dtype="Int64"),
            "label": [run_label(run)] * len(keep),
            "step": pd.array([columns["step"][i] for i in keep], dtype="Int64"),
            "x": pd.array([xs[i] for i in keep], dtype="Float64"),
            "raw": pd.array([shown[i] for i in keep], dtype="Float64"),
            "smoothed": pd.array([smooth[i] for i in keep], dtype="Float64"),
        }))
    empty = pd.DataFrame({"run": [], "label": [], "step": [], "x": [], "raw": [], "smoothed": []})
    return Overlay(pd.concat(parts, ignore_index=True) if parts else empty, hidden)

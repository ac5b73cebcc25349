"""Altair chart builders for training runs: curves against step, per-rank times, memory.

Inputs are the plain column-wise data of `queries`; every series is thinned by
`downsample` first, so a chart holds at most `MAX_ROWS_PER_CHART` rows however long the
run (Altair's `to_dict()` refuses more than 5,000, and browsers slow down well before).
A builder returns None when there is nothing measured to draw: the page then says so,
rather than drawing an empty or zero line.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from sae_dist.analytics.downsample import (
    MAX_POINTS_PER_SERIES,
    MAX_ROWS_PER_CHART,
    downsample,
    downsample_indices,
    points_per_series,
)

METRIC_LABELS = {
    "loss": "Loss",
    "mse": "MSE",
    "fvu": "FVU (fraction of variance unexplained)",
    "explained_variance": "Explained variance",
    "l0": "L0 (active latents per sample)",
    "dead_fraction": "Dead latents (fraction)",
    "auxk_loss": "AuxK loss",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm",
    "samples_per_s": "Throughput (samples/s)",
}
METRIC_FORMATS = {"dead_fraction": ".1%", "explained_variance": ".3f", "l0": ".2f", "lr": ".2e"}

STRAGGLER_COLOR = "#d62728"
CHART_HEIGHT = 220
STRAGGLER_BUDGET = 1_000  # rows of straggler marks per chart, out of MAX_ROWS_PER_CHART


def training_curve(metrics: dict[str, list], metric: str,
                   max_points: int = MAX_POINTS_PER_SERIES) -> alt.Chart | None:
    """One metric against step (`metrics` from `queries.run_step_metrics`); None if the run
    has no measured value of it yet."""
    steps, values = downsample(metrics["step"], metrics[metric], max_points)
    if not steps:
        return None
    label = METRIC_LABELS.get(metric, metric)
    value_format = METRIC_FORMATS.get(metric, ".4g")
    # "~g" (trailing zeros trimmed) keeps ticks of a nearly flat series apart (L0 of a TopK
    # SAE: 3.9998, 4) where a fixed precision would print one label five times.
    axis = alt.Axis(format=value_format if value_format.endswith("%") else "~g")
    data = pd.DataFrame({"step": steps, "value": values})
    line = alt.Chart(data).mark_line(point=len(steps) <= 60, interpolate="linear")
    return line.encode(
        x=alt.X("step:Q", title="Step"),
        y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False),
                axis=axis),
        tooltip=[alt.Tooltip("step:Q", title="Step", format=","),
                 alt.Tooltip("value:Q", title=label, format=value_format)],
    ).properties(title=label, height=CHART_HEIGHT)


def rank_time_chart(stats: dict[str, list], field: str = "step_time_s") -> alt.LayerChart | None:
    """Per-rank `field` ("step_time_s" or "compute_time_s", seconds) against step, one line
    per rank, stragglers marked as red triangles; None without rank stats."""
    if field not in ("step_time_s", "compute_time_s"):
        raise ValueError(f"field must be step_time_s or compute_time_s, got {field!r}")
    ranks = sorted(set(stats["rank"]))
    if not ranks:
        return None
    per_series = points_per_series(len(ranks), MAX_ROWS_PER_CHART - STRAGGLER_BUDGET)
    lines: dict[str, list] = {"step": [], "rank": [], "ms": []}
    marks: dict[str, list] = {"step": [], "rank": [], "ms": []}
    for rank in ranks:
        rows = [i for i, r in enumerate(stats["rank"]) if r == rank]
        label = _rank_label(rank, stats["device"][rows[-1]])
        values = [stats[field][i] for i in rows]
        for j in downsample_indices(values, per_series):
            lines["step"].append(stats["step"][rows[j]])
            lines["rank"].append(label)
            lines["ms"].append(1000 * values[j])
        flagged = [j for j, i in enumerate(rows) if stats["is_straggler"][i]]
        keep = downsample_indices([values[j] for j in flagged],
                                  max(4, STRAGGLER_BUDGET // len(ranks)))
        for k in keep:
            j = flagged[k]
            marks["step"].append(stats["step"][rows[j]])
            marks["rank"].append(label)
            marks["ms"].append(1000 * values[j])
    title = "Step time per rank" if field == "step_time_s" else "Compute time per rank"
    tooltip = [alt.Tooltip("rank:N", title="Rank"), alt.Tooltip("step:Q", title="Step", format=","),
               alt.Tooltip("ms:Q", title="Time (ms)", format=".2f")]
    x = alt.X("step:Q", title="Step")
    y = alt.Y("ms:Q", title="ms", scale=alt.Scale(zero=False))
    line = alt.Chart(pd.DataFrame(lines)).mark_line().encode(
        x=x, y=y, color=alt.Color("rank:N", title="Rank"), tooltip=tooltip)
    straggler = alt.Chart(pd.DataFrame(marks)).mark_point(
        shape="triangle-up", filled=True, size=70, color=STRAGGLER_COLOR, opacity=0.9,
    ).encode(x=x, y=y, tooltip=[*tooltip, alt.Tooltip("straggler:N", title="Straggler")]
             ).transform_calculate(straggler="'yes'")
    subtitle = (f"{sum(stats['is_straggler'])} straggler marks (red)" if any(stats["is_straggler"])
                else "no straggler flagged")
    return alt.layer(line, straggler).properties(
        title=alt.TitleParams(title, subtitle=subtitle), height=CHART_HEIGHT)


def peak_memory_chart(ranks: list[dict[str, Any]]) -> alt.Chart | None:
    """Peak memory per rank over the run (`queries.rank_summary` rows), in MiB; None when no
    rank measured it."""
    measured = [r for r in ranks if r["peak_memory_bytes"] is not None]
    if not measured:
        return None
    data = pd.DataFrame({
        "rank": [_rank_label(r["rank"], r["device"]) for r in measured],
        "mib": [r["peak_memory_bytes"] / 2**20 for r in measured],
    })
    return alt.Chart(data).mark_bar().encode(
        x=alt.X("rank:N", title="Rank", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("mib:Q", title="MiB"),
        tooltip=[alt.Tooltip("rank:N", title="Rank"),
                 alt.Tooltip("mib:Q", title="Peak memory (MiB)", format=",.1f")],
    ).properties(title="Peak memory per rank", height=CHART_HEIGHT)


def _rank_label(rank: int, device: str | None) -> str:
    return f"{rank} ({device})" if device else str(rank)

"""The Monitor's training section as plain data the page draws: its cards and its charts as
Vega-Lite specs (`chart_stack.stack_spec`), built from the run's curves in one go.

A live Monitor redraws every 2 s and most redraws find no new logged step: the page caches
what is built here by the run's last step, so only a new step pays for building the charts
again (0.3-0.6 s of a script run on the bench database). Nothing here imports Streamlit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sae_dist import format as fmt
from sae_dist.analytics import cards, charts
from sae_dist.analytics.chart_stack import stack_spec


@dataclass
class View:
    """One chart element: `spec` (None when none of its charts was drawn), its alt text, and
    what to say in words for each chart not drawn (nothing measured)."""

    spec: dict[str, Any] | None
    alt: str
    missing: list[str] = field(default_factory=list)


@dataclass
class TrainingViews:
    """The training section: the cards, whether any step was logged, the curves as two
    stacked columns; feature recovery's cards and columns, and whether it has a chart."""

    cards: list[cards.Card]
    has_steps: bool
    columns: list[View]
    recovery_cards: list[cards.Card]
    recovery: list[View]
    recovery_drawn: bool


def stack_view(plots: Sequence[tuple]) -> View:
    """`plots` as (chart or None, its alt text, what to say without it), one above another
    in one view."""
    return View(stack_spec([chart for chart, _, _ in plots]),
                "; ".join(alt for chart, alt, _ in plots if chart is not None),
                [missing for chart, _, missing in plots if chart is None and missing])


def column_views(plots: Sequence[tuple], columns: int = 2) -> list[View]:
    """`plots` read left to right then down in `columns` columns, each column one view."""
    return [stack_view(plots[i::columns]) for i in range(columns)]


def training_views(curves: dict[str, list], events: list[dict] | None, final: bool,
                   metrics: Sequence[str], recovery_metrics: Sequence[str]) -> TrainingViews:
    """The section from `samples.run_curves` output; `events` drawn on the curves (None:
    not drawn). Each card is its chart's last point (`cards`)."""
    panels = {metric: charts.binned_panel(curves, metric, events) for metric in metrics}
    plots = [(panel.chart, f"{panel.unit.title} against step",
              f"{panel.unit.title}: not measured ({fmt.MISSING})") for panel in panels.values()]
    recovery = {metric: charts.binned_panel(curves, metric) for metric in recovery_metrics}
    return TrainingViews(
        cards=cards.training_cards(panels, final), has_steps=bool(curves["step"]),
        columns=column_views(plots),
        recovery_cards=cards.training_cards(recovery, final),
        recovery=column_views([(panel.chart, f"{panel.unit.title} against step", None)
                               for panel in recovery.values()]),
        recovery_drawn=any(panel.chart is not None for panel in recovery.values()))


def rank_time_view(times: dict[str, list], field: str, events: list[dict] | None) -> View:
    """Each rank's time per step (`samples.rank_times` rows), or words when none was logged."""
    return stack_view([(charts.binned_rank_time_chart(times, field, events),
                        "Time per step of each rank against step, stragglers and run events "
                        "marked", "Time per rank: no per-rank statistics logged yet.")])

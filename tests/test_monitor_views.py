"""The Monitor's training section built ahead as plain data (monitor_views): the cards are the
charts' last points, the curves go into two stacked columns in reading order, a metric never
measured is said in words, and nothing is drawn for what was never logged."""

from __future__ import annotations

import json

import pytest

from sae_dist.analytics import monitor_views, units

METRICS = ("loss", "fvu", "l0", "dead_fraction", "samples_per_s")
RECOVERY = ("recovery_frac", "recovery_mean_cos")


def curves(n: int = 20, width: int = 10, **columns) -> dict:
    out = {"width": width, "step": [width * (i + 1) for i in range(n)]}
    for metric in (*METRICS, *RECOVERY):
        values = columns.get(metric, [1.0 / (i + 1) for i in range(n)])
        out[metric] = values
        out[f"{metric}_min"] = [None if v is None else v * 0.9 for v in values]
        out[f"{metric}_max"] = [None if v is None else v * 1.1 for v in values]
    return out


def titles(view: monitor_views.View) -> list[str]:
    spec = view.spec or {}
    charts = spec.get("concat", [spec] if spec else [])
    return [c["title"]["text"] if isinstance(c["title"], dict) else c["title"] for c in charts]


@pytest.mark.slow  # 1 s or more on a loaded machine (Altair's first charts)
def test_the_curves_go_left_then_right_with_their_cards():
    views = monitor_views.training_views(curves(), None, False, METRICS, RECOVERY)
    assert views.has_steps and views.recovery_drawn
    left, right = views.columns
    assert titles(left) == [units.TRAINING[m].title for m in ("loss", "l0", "samples_per_s")]
    assert titles(right) == [units.TRAINING[m].title for m in ("fvu", "dead_fraction")]
    assert left.missing == [] and "Loss against step" in left.alt
    # Each card is its chart's last point: the last bucket's mean, in the chart's unit.
    assert [c.label for c in views.cards][:2] == ["Latest loss", "Latest FVU"]
    assert views.cards[0].value == units.TRAINING["loss"].text(1 / 20)
    assert [titles(v) for v in views.recovery] == [[units.TRAINING["recovery_frac"].title],
                                                   [units.TRAINING["recovery_mean_cos"].title]]
    frames = left.spec["datasets"]
    assert len(frames["data-0"]) == 20 and list(frames["data-0"]["step"])[-1] == 200
    json.dumps({k: v for k, v in left.spec.items() if k != "datasets"})  # a plain spec


def test_a_metric_never_measured_is_said_not_drawn():
    views = monitor_views.training_views(curves(l0=[None] * 20, recovery_frac=[None] * 20,
                                                recovery_mean_cos=[None] * 20),
                                         None, True, METRICS, RECOVERY)
    left, _ = views.columns
    assert titles(left) == [units.TRAINING[m].title for m in ("loss", "samples_per_s")]
    assert left.missing == [f"{units.TRAINING['l0'].title}: not measured (—)"]
    assert views.cards[2].label == "Final L0" and views.cards[2].value == "—"
    assert not views.recovery_drawn and all(v.spec is None for v in views.recovery)


def test_nothing_logged_draws_nothing():
    views = monitor_views.training_views(curves(n=0), None, False, METRICS, RECOVERY)
    assert not views.has_steps and all(v.spec is None for v in views.columns)
    empty = {"width": 1, "step": [], "rank": [], "device": [], "mean_s": [], "max_s": [],
             "stragglers": []}
    view = monitor_views.rank_time_view(empty, "step_time_s", None)
    assert view.spec is None and view.missing == ["Time per rank: no per-rank statistics logged yet."]
    times = {"width": 1, "step": [10, 20, 10, 20], "rank": [0, 0, 1, 1], "device": ["a"] * 4,
             "mean_s": [0.1, 0.1, 0.2, 0.3], "max_s": [0.1, 0.1, 0.2, 0.4], "stragglers": [0, 0, 0, 1]}
    view = monitor_views.rank_time_view(times, "step_time_s", None)
    assert titles(view) == ["Step time per rank"] and view.missing == []

"""The Sweeps page's overlaid curves (`sweep_curves`) on plain data: the rows each chart ships
(each SAE thinned by the one downsampling rule, nothing unmeasured) and the spec written
directly (one view a column, one dataset a chart, nothing per point but the tooltip)."""

from __future__ import annotations

import math

from sae_dist.analytics import sweep_curves
from sae_dist.analytics.run_compare import color_scale

RUNS = [{"id": 3, "name": "k4"}, {"id": 5, "name": "k8"}]


def columns(n: int, loss=lambda s: 1.0 / s, l0=lambda s: 4.0) -> dict[str, list]:
    steps = list(range(10, 10 * n + 1, 10))
    return {"step": steps, "loss": [loss(s) for s in steps], "l0": [l0(s) for s in steps],
            "dead_fraction": [None] * n}


def test_each_chart_ships_label_step_and_its_metric_thinned_to_its_share():
    series = [(RUNS[0], columns(300)), (RUNS[1], columns(40))]
    rows = sweep_curves.metric_rows(series, "loss", max_rows=200)  # 100 points an SAE at most
    assert list(rows.columns) == ["label", "step", "loss"]
    assert (rows["label"] == "3 · k4").sum() == 100 and (rows["label"] == "5 · k8").sum() == 40
    first = rows[rows["label"] == "3 · k4"]
    assert (first["step"].iloc[0], first["step"].iloc[-1]) == (10, 3000)  # starts and ends where the SAE did
    assert first["loss"].max() == 0.1 and first["loss"].min() == 1 / 3000  # the extremes kept
    assert str(rows["step"].dtype) == "int64" and str(rows["loss"].dtype) == "float64"


def test_unmeasured_and_non_finite_values_are_never_shipped():
    odd = columns(4, loss=lambda s: {10: None, 20: math.nan, 30: math.inf}.get(s, 0.5))
    rows = sweep_curves.metric_rows([(RUNS[0], odd)], "loss")
    assert list(rows["step"]) == [40] and list(rows["loss"]) == [0.5]
    assert len(sweep_curves.metric_rows([(RUNS[0], odd)], "dead_fraction")) == 0
    assert len(sweep_curves.metric_rows([], "loss")) == 0


def test_a_column_is_one_view_one_dataset_a_chart_and_says_what_was_not_measured():
    series = [(RUNS[0], columns(5)), (RUNS[1], columns(5))]
    colors = color_scale([{**r} for r in RUNS])
    left, right = sweep_curves.curve_views(series, ("loss", "dead_fraction", "l0"), colors)
    assert [c["title"] for c in left.spec["concat"]] == ["Loss · runs compared",
                                                         "L0 (active latents per sample) · runs compared"]
    assert set(left.spec["datasets"]) == {"loss", "l0"} and left.missing == []
    loss = left.spec["concat"][0]
    assert loss["data"] == {"name": "loss", "format": {"parse": None}}  # typed columns: no per-row parse
    assert loss["mark"]["aria"] is False and loss["mark"]["invalid"] == "filter"
    assert loss["encoding"]["color"]["scale"] == {"domain": ["3 · k4", "5 · k8"], "range": colors[1]}
    assert [t["title"] for t in loss["encoding"]["tooltip"]] == ["Run", "Step", "Loss"]  # hover names the SAE
    assert right.spec is None and right.missing == ["Dead latents (fraction) · runs compared: not measured (—)"]

"""The pure pieces of the "Compare runs" view with plain data: TensorBoard's debiased EMA, the
Pareto frontier and each run's point, the config diff, colours, the x axis, the default run,
the rows of an overlaid chart and its spec (log scale), and the latest-evaluations query."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest

from sae_dist.analytics import compare_charts, queries
from sae_dist.analytics.config_diff import NOT_SET, config_diff, flatten
from sae_dist.analytics.pareto import (
    FROM_EVALUATION,
    FROM_TRAINING,
    SELECTION,
    caption,
    pareto_frontier,
    picked_run,
    run_points,
)
from sae_dist.analytics.run_compare import (
    OVERLAY_POINTS_PER_RUN,
    OVERLAY_ROWS,
    PALETTE,
    color_scale,
    compare_default,
    default_run,
    key_html,
    log_visible,
    overlay_frame,
    run_colors,
    x_values,
)
from sae_dist.analytics.smoothing import ema_debiased
from sae_dist.db import create_run, get_engine
from sae_dist.db.evaluations import record_evaluation

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


# ---- smoothing: TensorBoard's EMA, computed by hand -------------------------------------------

def test_ema_matches_a_hand_computation():
    # w = 0.5: last = 0.5, 1.25, 2.125; debias 1 - 0.5^n = 0.5, 0.75, 0.875.
    assert ema_debiased([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    # w = 0.9, one point: 0.1 * 10 / (1 - 0.9) = 10 (debiasing removes the pull toward 0).
    assert ema_debiased([10.0], 0.9) == pytest.approx([10.0])
    # w = 0.6, TensorBoard's default: 0.4*4 = 1.6 / 0.4; then 0.96 + 0.4*0 = 0.96 / 0.64.
    assert ema_debiased([4.0, 0.0], 0.6) == pytest.approx([4.0, 0.96 / 0.64])


def test_ema_skips_missing_values_without_counting_them():
    # The gap keeps n at 1: the 3 is the second measured point (last 0.25 + 1.5, debias 0.75).
    assert ema_debiased([1.0, None, 3.0], 0.5) == pytest.approx([1.0, None, 1.75 / 0.75])
    out = ema_debiased([math.nan, 2.0, math.inf, 4.0], 0.5)
    assert out[0] is None and out[2] is None
    assert out[1] == pytest.approx(2.0) and out[3] == pytest.approx(2.5 / 0.75)


def test_ema_leaves_constant_series_zero_weight_and_empty_input_alone():
    assert ema_debiased([3.0, 3.0, 3.0], 0.99) == [3.0, 3.0, 3.0]  # exactly, as TensorBoard
    assert ema_debiased([1.0, 5.0, 2.0], 0.0) == [1.0, 5.0, 2.0]
    assert ema_debiased([], 0.5) == []
    with pytest.raises(ValueError):
        ema_debiased([1.0], 1.5)


# ---- Pareto: the frontier, each run's point, the click ---------------------------------------

def point(run: int, l0: float | None, fvu: float | None) -> dict:
    return {"run": run, "l0": l0, "fvu": fvu}


def test_frontier_keeps_only_points_nothing_beats():
    points = [point(1, 8, 0.30), point(2, 16, 0.20), point(3, 16, 0.25),  # 3: beaten by 2
              point(4, 32, 0.20),  # beaten by 2 (same FVU, more L0)
              point(5, 64, 0.10), point(6, 4, 0.50), point(7, 12, 0.40)]  # 7: beaten by 1
    assert [p["run"] for p in pareto_frontier(points)] == [6, 1, 2, 5]


def test_frontier_edge_cases():
    assert pareto_frontier([]) == []
    assert [p["run"] for p in pareto_frontier([point(1, 8, 0.3)])] == [1]
    # Identical points are both on it; a point missing a figure is left out.
    same = pareto_frontier([point(1, 8, 0.3), point(2, 8, 0.3), point(3, None, 0.1), point(4, 2, math.nan)])
    assert [p["run"] for p in same] == [1, 2]


def run(run_id: int, **changes) -> dict:
    base = {"id": run_id, "name": f"run-{run_id}", "status": "COMPLETED", "final": True,
            "last_step": 100, "l0": 8.0, "fvu": 0.3, "last_update": T0, "started_at": T0}
    return {**base, **changes}


def test_run_points_take_the_evaluation_else_the_last_step_and_say_which():
    runs = [run(1), run(2, final=False, status="RUNNING", last_step=40),
            run(3, l0=None, fvu=None, last_update=None),  # nothing measured: no point
            run(4)]
    evaluations = {1: {"fvu": 0.25, "l0": 7.5, "origin": "heldout", "rows": 4096},
                   4: {"fvu": None, "l0": 7.0, "origin": "cli", "rows": 10}}  # no FVU: training's
    points = {p["run"]: p for p in run_points(runs, evaluations)}
    assert set(points) == {1, 2, 4}
    assert (points[1]["l0"], points[1]["fvu"], points[1]["source"]) == (7.5, 0.25, FROM_EVALUATION)
    assert points[1]["measured_on"] == "evaluation on 4,096 held-out rows"
    assert (points[2]["l0"], points[2]["source"]) == (8.0, FROM_TRAINING)
    assert points[2]["measured_on"] == "training, latest logged step (40)"
    assert (points[4]["l0"], points[4]["source"]) == (8.0, FROM_TRAINING)
    assert points[4]["measured_on"] == "training, final step (100)"


def test_the_caption_says_where_points_come_from_which_runs_lack_one_and_the_limit():
    training = {"source": FROM_TRAINING}
    one_source = caption([training, training], 2, 200)
    assert one_source.endswith("says which.") and "no point" not in one_source
    mixed = caption([training, {"source": FROM_EVALUATION}], 5, 5)
    assert "not measured on the same rows" in mixed
    assert "3 runs have no point (L0 or FVU never measured)" in mixed and "The newest 5 runs only." in mixed
    assert "1 run has no point" in caption([training], 2, 200)


def test_picked_run_reads_the_selection_state():
    assert picked_run({"selection": {SELECTION: [{"run": 7}]}}) == 7
    assert picked_run({"selection": {SELECTION: {}}}) is None  # nothing clicked yet
    assert picked_run({"selection": {SELECTION: []}}) is None
    assert picked_run({"selection": {}}) is None
    assert picked_run(None) is None


# ---- config diff -----------------------------------------------------------------------------

def test_config_diff_lists_only_keys_that_differ():
    a = {"k": 4, "lr": 0.001, "architecture": "topk", "sched": {"warmup": 10, "decay": 0.2},
         "devices": [0, 1], "flag": True}
    b = {"k": 8, "lr": 1e-3, "architecture": "topk", "sched": {"warmup": 10, "decay": 0.5},
         "devices": [0, 1], "flag": 1, "seed": 3}
    rows = config_diff({"1 · a": a, "2 · b": b})
    assert [r["key"] for r in rows] == ["flag", "k", "sched.decay", "seed"]
    by_key = {r["key"]: r for r in rows}
    assert by_key["k"] == {"key": "k", "1 · a": "4", "2 · b": "8"}
    assert by_key["flag"] == {"key": "flag", "1 · a": "true", "2 · b": "1"}  # True is not 1
    assert by_key["seed"]["1 · a"] == NOT_SET and by_key["seed"]["2 · b"] == "3"
    assert by_key["sched.decay"]["2 · b"] == "0.5"


def test_config_diff_of_one_run_or_equal_runs_is_empty_and_flatten_dots_keys():
    assert config_diff({"1 · a": {"k": 4}}) == []
    assert config_diff({"1 · a": {"k": 4, "x": None}, "2 · b": {"k": 4.0, "x": None}}) == []
    assert config_diff({"1 · a": {"x": None}, "2 · b": {}})[0]["1 · a"] == "null"
    assert flatten({"a": {"b": {"c": 1}}, "d": {}, "e": [1]}) == {"a.b.c": 1, "d": {}, "e": [1]}


# ---- colours, the x axis, the default run ----------------------------------------------------

def test_each_run_keeps_one_colour_in_run_id_order():
    assert run_colors([9, 3, 5]) == {3: PALETTE[0], 5: PALETTE[1], 9: PALETTE[2]}
    assert run_colors(range(12))[10] == PALETTE[0]  # more runs than colours: the palette again
    domain, palette = color_scale([run(9), run(3)])
    assert domain == ["3 · run-3", "9 · run-9"] and palette == [PALETTE[0], PALETTE[1]]
    key = key_html([run(9, name="<b>x</b>"), run(3)])  # the charts' one key, same colours
    assert key.index(f"color:{PALETTE[0]}") < key.index("3 · run-3") < key.index(f"color:{PALETTE[1]}")
    assert "9 · &lt;b&gt;x&lt;/b&gt;" in key and "<b>" not in key


def test_x_values_by_step_samples_or_seconds_since_start():
    columns = {"step": [10, 20], "samples_seen": [2560, 5120],
               "time": [T0 + timedelta(seconds=5), T0 + timedelta(seconds=12.5)]}
    assert x_values(columns, "step", T0) == [10, 20]
    assert x_values(columns, "samples", T0) == [2560, 5120]
    assert x_values(columns, "wall", T0) == [5.0, 12.5]
    assert x_values(columns, "wall", None) == [None, None]  # unknown start: unknown, not 0
    with pytest.raises(ValueError):
        x_values(columns, "epoch", T0)


def test_the_page_opens_on_the_newest_run_that_logged_a_step():
    empty_cancelled = run(5, status="STOPPED", last_update=None)
    assert default_run([empty_cancelled, run(4), run(2)]) == 4
    assert default_run([run(3, last_update=None), run(1, last_update=None)]) == 3  # none has steps
    assert default_run([]) is None
    assert compare_default([empty_cancelled, run(4), run(2)], 2) == [2]  # the open run
    assert compare_default([empty_cancelled, run(4), run(2)], 5) == [4]  # open but empty
    assert compare_default([], None) == []


# ---- the rows and spec of an overlaid chart --------------------------------------------------

def columns_of(values: list, start: int = 1) -> dict[str, list]:
    steps = list(range(start, start + len(values)))
    return {"step": steps, "samples_seen": [s * 256 for s in steps],
            "time": [T0 + timedelta(seconds=s) for s in steps], "loss": values}


def test_overlay_frame_smooths_before_thinning_and_caps_rows():
    values = [float(i % 7) + 1 for i in range(5000)]
    series = [(run(1), columns_of(values)), (run(2), columns_of(values))]
    frame = overlay_frame(series, "loss", "step", 0.5, False).frame
    assert len(frame) <= OVERLAY_ROWS and set(frame["run"]) == {1, 2}
    alone = overlay_frame(series[:1], "loss", "step", 0.5, False).frame
    assert len(alone) <= OVERLAY_POINTS_PER_RUN < len(frame)  # a run alone gets more of the chart
    one = frame[frame["run"] == 1]
    smoothed = ema_debiased(values, 0.5)  # of the whole series, read at the kept steps
    assert list(one["smoothed"]) == pytest.approx([smoothed[s - 1] for s in one["step"]])
    assert one["raw"].max() == 7.0 and one["raw"].min() == 1.0  # min/max kept by downsampling
    assert list(one["label"].unique()) == ["1 · run-1"]


def test_log_scale_hides_values_at_or_below_zero_and_counts_them():
    assert log_visible([1.0, 0.0, -2.0, None, 3.0], True) == [1.0, None, None, None, 3.0]
    assert log_visible([0.0], False) == [0.0]
    overlay = overlay_frame([(run(1), columns_of([0.0, 0.5, 0.0, 0.25]))], "loss", "step", 0.0, True)
    assert overlay.hidden == 2 and list(overlay.frame["raw"]) == [0.5, 0.25]
    zeros = overlay_frame([(run(1), columns_of([0.0, 0.0]))], "loss", "step", 0.0, True)
    assert compare_charts.overlay_chart(zeros, "loss", "step", color_scale([run(1)]), 0.0, True) is None
    assert "0 or below" in compare_charts.empty_text(zeros, "loss")


def chart_spec(weight: float, log: bool, x: str = "step") -> dict:
    series = [(run(1), columns_of([3.0, 2.0, 1.5])), (run(2), columns_of([4.0, 1.0]))]
    overlay = overlay_frame(series, "loss", x, weight, log)
    chart = compare_charts.overlay_chart(overlay, "loss", x, color_scale([r for r, _ in series]),
                                         weight, log)
    return chart.to_dict()


def test_chart_spec_has_log_scale_only_when_toggled_and_a_fixed_colour_scale():
    log_spec = chart_spec(0.0, True)
    assert log_spec["encoding"]["y"]["scale"]["type"] == "log"
    assert "log scale" in log_spec["title"]["subtitle"]
    linear = chart_spec(0.0, False)
    assert "type" not in linear["encoding"]["y"]["scale"] and linear["title"] == "Loss · runs compared"
    color = linear["encoding"]["color"]["scale"]
    assert color == {"domain": ["1 · run-1", "2 · run-2"], "range": [PALETTE[0], PALETTE[1]]}


def test_chart_spec_draws_the_smoothed_line_over_a_faint_raw_one():
    spec = chart_spec(0.6, False, "wall")
    raw, smooth = spec["layer"]
    assert raw["mark"]["opacity"] == compare_charts.RAW_OPACITY and "opacity" not in smooth["mark"]
    assert raw["encoding"]["y"]["field"] == "raw" and smooth["encoding"]["y"]["field"] == "smoothed"
    assert raw["encoding"]["x"]["title"] == "Seconds since the run started"
    xs = spec["datasets"][spec["data"]["name"]]
    assert [r["x"] for r in xs] == [1.0, 2.0, 3.0, 1.0, 2.0]  # the steps' seconds after T0
    assert "EMA 0.6" in spec["title"]["subtitle"]
    titles = [t["title"] for t in raw["encoding"]["tooltip"]]
    assert titles == ["Run", "Step", "Seconds since the run started", "Loss", "Smoothed"]
    assert [t["title"] for t in chart_spec(0.0, False)["encoding"]["tooltip"]] == ["Run", "Step", "Loss"]


def test_pareto_chart_draws_the_frontier_and_a_click_selection():
    points = run_points([run(1, l0=8.0, fvu=0.3), run(2, l0=16.0, fvu=0.2), run(3, l0=16.0, fvu=0.4)], {})
    spec = compare_charts.pareto_chart(points, pareto_frontier(points), {2: PALETTE[0]}).to_dict()
    line, dots = spec["layer"]
    assert line["mark"]["interpolate"] == "step-after"
    frontier = spec["datasets"][line["data"]["name"]]
    assert [(r["l0"], r["fvu"]) for r in frontier] == [(8.0, 0.3), (16.0, 0.2)]
    assert spec["params"][0]["name"] == SELECTION and spec["params"][0]["select"]["fields"] == ["run"]
    colors = {r["run"]: r["color"] for r in spec["datasets"][dots["data"]["name"]]}
    assert colors == {1: compare_charts.OTHER_RUN_COLOR, 2: PALETTE[0], 3: compare_charts.OTHER_RUN_COLOR}
    assert compare_charts.pareto_chart([], [], {}) is None


# ---- the query -------------------------------------------------------------------------------

def test_latest_evaluations_gives_each_runs_newest(state_home):
    engine = get_engine()
    ids = [create_run(engine, name=f"r{i}", status="COMPLETED", architecture="topk", config_json="{}",
                      world_size=1, backend="gloo", device_ids='["cpu:0"]', host="h",
                      run_dir=f"/tmp/r{i}", total_steps=10) for i in range(3)]
    density = {"edges": [0.0, 1.0], "counts": [1], "never": 0}
    for fvu, run_id in ((0.5, ids[0]), (0.25, ids[0]), (0.125, ids[1]), (0.9, None)):
        record_evaluation(engine, {"rows": 64, "fvu": fvu, "l0": 4.0, "density": density},
                          "/sae", "/data", run_id=run_id, where="heldout")
    latest = queries.latest_evaluations(engine)
    assert latest == {ids[0]: {"fvu": 0.25, "l0": 4.0, "origin": "heldout", "rows": 64},
                      ids[1]: {"fvu": 0.125, "l0": 4.0, "origin": "heldout", "rows": 64}}
    assert json.dumps(latest)  # plain data

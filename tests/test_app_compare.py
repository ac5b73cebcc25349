"""The Training runs page's "Compare runs" tab with AppTest over a real state database: the runs
picked, smoothing, log scale, the x axis, the config diff, the L0-FVU chart and a click on it;
and the Run tab opening on the latest run that logged a step."""

from __future__ import annotations

import json

import pytest
from streamlit.proto.WidgetStates_pb2 import WidgetState
from streamlit.testing.v1 import AppTest

from chart_views import page_charts
from conftest import REPO
from sae_dist.analytics.pareto import SELECTION
from sae_dist.analytics.run_compare import PALETTE
from sae_dist.analytics.smoothing import ema_debiased
from sae_dist.db import create_run, get_engine, update_run
from sae_dist.db.evaluations import record_evaluation
from test_app import add_run

RUNS = "pages/4_Training_runs.py"
COMPARE = "Compare runs"
CURVES = ("Loss", "FVU (fraction of variance unexplained)", "L0 (active latents per sample)",
          "Dead latents (fraction)", "Throughput (samples/s)")


@pytest.fixture(autouse=True)
def environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


@pytest.fixture
def runs(state_home):
    """A finished run with an evaluation, a running one, and (newest) an empty cancelled one."""
    engine = get_engine()
    done = add_run(engine, "finished-run", "COMPLETED", list(range(10, 201, 10)), 200)
    density = {"edges": [-2.0, -1.0, 0.0], "counts": [3, 5], "never": 0}
    record_evaluation(engine, {"rows": 4096, "fvu": 0.004, "l0": 3.5, "density": density},
                      "/sae", "/data", run_id=done, where="heldout")
    live = add_run(engine, "running-run", "RUNNING", [10, 20, 30], 300)
    update_run(engine, live, config_json=json.dumps({"architecture": "topk", "k": 8, "steps": 300}))
    empty = create_run(engine, name="cancelled-empty", status="STOPPED", architecture="topk",
                       config_json="{}", world_size=1, backend="gloo", device_ids='["cpu:0"]',
                       host="testhost", run_dir="/tmp/cancelled-empty", total_steps=100)
    return {"done": done, "live": live, "empty": empty}


def open_page(**query) -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=30).run()
    for name, value in query.items():
        at.query_params[name] = value
    at.switch_page(RUNS).run()
    assert not at.exception
    return at


def charts(at: AppTest) -> dict[str, dict]:
    """Each chart on the page by title: its spec, with its view's datasets as lists of rows."""
    return {chart.title: {**chart.spec, "rows": chart.frames} for chart in page_charts(at)}


def compared(at: AppTest) -> dict[str, dict]:
    return {title.removesuffix(" · runs compared"): spec for title, spec in charts(at).items()
            if title.endswith("runs compared")}


def layers(spec: dict) -> list[dict]:
    return spec.get("layer", [spec])


def frame(spec: dict):
    return next(iter(spec["rows"].values()))


def captions(at: AppTest) -> str:
    return "\n".join(c.value for c in at.caption)


@pytest.mark.slow  # 1 s or more (several AppTest runs of the page)
def test_the_run_tab_opens_on_the_latest_run_with_steps_not_an_empty_cancelled_one(runs):
    at = open_page()
    assert at.selectbox(key="run_pick").value == runs["live"]
    assert at.query_params["run"] == str(runs["live"])
    assert "Learning rate" not in " ".join(charts(at))  # the Run tab alone: no comparison drawn
    at = open_page(run=str(runs["empty"]))  # still opened when asked for
    assert at.selectbox(key="run_pick").value == runs["empty"]


def test_compare_tab_defaults_to_the_latest_run_with_steps_and_draws_its_curves(runs):
    at = open_page(view=COMPARE)
    assert at.multiselect(key="compare_pick").value == [runs["live"]]
    assert not at.get("selectbox")  # the Run tab did not run
    drawn = compared(at)
    assert set(drawn) == set(CURVES)
    assert "Learning rate · runs compared: not measured (—)" in captions(at)
    loss = frame(drawn["Loss"])
    assert list(loss["step"]) == [10, 20, 30] and list(loss["raw"]) == pytest.approx([0.2, 0.1, 2 / 30])
    assert "Pick two or more runs" in captions(at)


@pytest.mark.slow  # 1 s or more (several AppTest runs of the page)
def test_comparing_two_runs_colours_each_alike_on_every_chart_and_diffs_configs(runs):
    at = open_page(view=COMPARE)
    at.multiselect(key="compare_pick").set_value([runs["live"], runs["done"]]).run()
    assert not at.exception
    domain = [f"{runs['done']} · finished-run", f"{runs['live']} · running-run"]
    for title, spec in compared(at).items():
        scale = layers(spec)[0]["encoding"]["color"]["scale"]
        assert scale == {"domain": domain, "range": [PALETTE[0], PALETTE[1]]}, title
        assert set(frame(spec)["label"]) == set(domain)
    key = next(m.value for m in at.markdown if "&#9632;" in m.value)  # the charts' one colour key
    assert f'color:{PALETTE[0]}">&#9632;</span> {domain[0]}' in key
    assert f'color:{PALETTE[1]}">&#9632;</span> {domain[1]}' in key
    diff = at.dataframe[0].value
    assert list(diff["key"]) == ["k", "steps"]
    assert list(diff[domain[0]]) == ["4", "200"] and list(diff[domain[1]]) == ["8", "300"]


def test_a_comparison_is_a_url_to_bookmark_or_send(runs):
    """The runs compared (by id) and how they are drawn are in the URL: picking runs writes them
    there, and a link naming them opens the same comparison."""
    at = open_page(view=COMPARE)
    at.multiselect(key="compare_pick").set_value([runs["live"], runs["done"]]).run()
    assert at.query_params["compare"] == f"{runs['live']},{runs['done']}"
    shared = open_page(view=COMPARE, compare=f"{runs['done']},{runs['live']},999", log_y="true")
    assert shared.multiselect(key="compare_pick").value == [runs["done"], runs["live"]]  # 999: no such run
    assert shared.toggle(key="log_y").value is True


def test_the_runs_a_link_names():
    from sae_dist.analytics.run_compare import link_value, runs_in_link

    assert runs_in_link("3,5", [1, 3, 5]) == [3, 5] and runs_in_link(" 5 , 3,5", [3, 5]) == [5, 3]
    assert runs_in_link("3,x,-1,٣,9", [3]) == [3] and runs_in_link("", [3]) == []
    assert runs_in_link(link_value([5, 3]), [3, 5]) == [5, 3]


@pytest.mark.slow  # 1 s or more (several AppTest runs of the page)
def test_smoothing_log_scale_and_x_axis_change_every_curve(runs):
    at = open_page(view=COMPARE)
    at.slider(key="smoothing").set_value(0.5).run()
    assert not at.exception
    loss = compared(at)["Loss"]
    raw, smooth = loss["layer"]
    assert raw["mark"]["opacity"] < 1 and smooth["encoding"]["y"]["field"] == "smoothed"
    rows = frame(loss)
    assert list(rows["smoothed"]) == pytest.approx(ema_debiased(list(rows["raw"]), 0.5))
    assert "EMA 0.5" in loss["title"]["subtitle"]

    at.toggle(key="log_y").set_value(True).run()
    assert not at.exception
    for title, spec in compared(at).items():
        assert all(layer["encoding"]["y"]["scale"]["type"] == "log" for layer in layers(spec)), title
    # Dead latents are all 0: measured, but nothing a log scale can draw; said so, not "not measured".
    assert "Dead latents (fraction) · runs compared: every measured value is 0 or below" in captions(at)

    at.button_group(key="x_axis").set_value("samples").run()
    assert not at.exception
    fvu = compared(at)["FVU (fraction of variance unexplained)"]
    assert layers(fvu)[0]["encoding"]["x"]["title"] == "Samples seen"
    assert list(frame(fvu)["x"]) == [2560, 5120, 7680]  # samples_seen of steps 10, 20, 30
    at.button_group(key="x_axis").set_value("wall").run()
    seconds = frame(compared(at)["Loss"])["x"]
    assert seconds.is_monotonic_increasing and seconds.iloc[0] > 0  # logged after the start


def click(at: AppTest, key: str, run_id: int) -> AppTest:
    """What the browser sends when a point of the chart `key` is clicked: its selection state."""
    chart = next(c for c in at.get("vega_lite_chart") if c.proto.id.endswith(f"-{key}"))
    states = at._tree.get_widget_states()
    states.widgets.append(WidgetState(
        id=chart.proto.id, string_value=json.dumps({"selection": {SELECTION: [{"run": run_id}]}})))
    at._run(widget_state=states)
    assert not at.exception
    return at


@pytest.mark.slow  # 1 s or more (several AppTest runs of the page)
def test_the_l0_fvu_chart_marks_sources_and_a_click_opens_the_run(runs):
    at = open_page(view=COMPARE)
    pareto = charts(at)["L0 against FVU, every run"]
    line, dots = pareto["layer"]
    points = pareto["rows"][dots["data"]["name"]].set_index("run")
    assert set(points.index) == {runs["done"], runs["live"]}  # the empty run has no point
    assert points.loc[runs["done"], "source"] == "evaluation"  # its evaluation, not training
    assert (points.loc[runs["done"], "l0"], points.loc[runs["done"], "fvu"]) == (3.5, 0.004)
    assert points.loc[runs["live"], "measured_on"] == "training, latest logged step (30)"
    assert points.loc[runs["live"], "color"] == PALETTE[0]  # compared: its curves' colour
    assert {t["title"] for t in dots["encoding"]["tooltip"]} >= {"Run", "L0", "FVU", "Measured on"}
    assert "not measured on the same rows" in captions(at)

    click(at, "pareto", runs["done"])
    assert at.selectbox(key="run_pick").value == runs["done"]  # the Run tab, on that run
    assert at.query_params["run"] == str(runs["done"])
    assert {m.label for m in at.metric} >= {"Final FVU"}
    at.session_state["view"] = COMPARE  # back: the run clicked is compared too
    at.run()
    assert at.multiselect(key="compare_pick").value == [runs["live"], runs["done"]]

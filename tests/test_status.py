"""scheduler.status (devices and queue as the app sees them), scheduler.submit (the demo job), and
the pure device presentation in sae_dist.analytics.devices: a real SQLite database in a temporary
home, 4 virtual devices, no daemon (SAE_DIST_AUTOSTART=0)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert

from conftest import REPO, run_cli
from sae_dist.analytics import devices as dev
from sae_dist.db import GpuSample, StepMetric, create_run, get_engine, update_run, utcnow
from scheduler import status
from scheduler.control import daemon_running, ensure_daemon
from scheduler.store import NewJob, finish_job, get_job, start_jobs, submit
from scheduler.submit import DEMO_DEVICES, submit_demo

DEVICES = 4


@pytest.fixture(autouse=True)
def virtual_devices(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", str(DEVICES))
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


# ---- helpers shared with the app tests ----

def command_job(engine, name: str = "sleeper", gpu_ids: list[str] | None = None, **fields) -> int:
    return submit(engine, NewJob(name=name, kind="command", argv=["sleep", "60"],
                                 gpus=len(gpu_ids) if gpu_ids else 1, workdir=str(REPO), gpu_ids=gpu_ids,
                                 **fields))


def running_job(engine, devices: list[str], kind: str = "command", name: str = "busy",
                started: datetime | None = None, **fields) -> int:
    """A RUNNING job holding `devices` (an allocation, as the daemon makes), with no process."""
    if kind == "train":
        job_id = submit(engine, NewJob(name=name, kind="train", argv=[], gpus=len(devices), workdir=str(REPO),
                                       train_config={"steps": 3000, "d_in": 64}, gpu_ids=devices, **fields))
    else:
        job_id = command_job(engine, name, devices, **fields)
    assert start_jobs(engine, [(job_id, tuple(devices))], {}, now=started)
    return job_id


def training_run(engine, job_id: int | None, total: int, logged: list[tuple[int, datetime]],
                 name: str = "run") -> int:
    """A RUNNING training run of a job, with steps logged at the given times."""
    start = logged[0][1] - timedelta(seconds=5) if logged else utcnow()
    run_id = create_run(engine, name=name, status="RUNNING", architecture="topk", config_json="{}",
                        world_size=2, backend="gloo", device_ids='["cpu:0", "cpu:1"]', host="testhost",
                        run_dir=f"/tmp/{name}", total_steps=total, job_id=job_id, started_at=start,
                        created_at=start)
    if logged:
        with engine.begin() as conn:
            conn.execute(insert(StepMetric.__table__), [
                {"run_id": run_id, "step": step, "samples_seen": 256 * step, "time": t, "loss": 1.0 / step}
                for step, t in logged])
        update_run(engine, run_id, last_step=logged[-1][0])
    return run_id


# ---- devices ----

def test_devices_now_on_virtual_devices():
    devices, states, allocations = status.devices_now(get_engine())
    assert [d.uuid for d in devices] == [f"virtual-{i}" for i in range(DEVICES)]
    assert all(d.virtual for d in devices)
    assert {s.state for s in states.values()} == {"idle"} and allocations == {}


def test_an_allocated_device_names_its_job():
    engine = get_engine()
    job_id = running_job(engine, ["virtual-1"])
    devices, states, allocations = status.devices_now(engine)
    assert allocations == {"virtual-1": job_id}
    assert states["virtual-1"].state == "allocated" and states["virtual-1"].job_id == job_id
    rows = status.device_rows(devices, states, {})
    row = rows[1]
    assert (row["state"], row["job_id"]) == ("allocated", job_id)
    assert dev.state_badge(row)[0] == f"job {job_id}"
    assert dev.why_not_selectable(row) == f"allocated to job {job_id}"
    assert dev.why_not_selectable(rows[0]) is None


def test_latest_samples_keeps_the_newest_fresh_one_per_device():
    engine = get_engine()
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(insert(GpuSample.__table__), [
            {"device_uuid": "virtual-0", "time": now - timedelta(seconds=60), "utilization_pct": 99.0},
            {"device_uuid": "virtual-0", "time": now - timedelta(seconds=1), "utilization_pct": 42.0},
            {"device_uuid": "virtual-1", "time": now - timedelta(seconds=60), "utilization_pct": 77.0},
        ])
    samples = status.latest_samples(engine, now=now.timestamp())
    assert set(samples) == {"virtual-0"} and samples["virtual-0"]["utilization_pct"] == 42.0

    devices, states, _ = status.devices_now(engine)
    rows = status.device_rows(devices, states, samples)
    assert (rows[0]["utilization_pct"], rows[0]["utilization_source"]) == (42.0, "daemon")
    assert rows[1]["utilization_source"] == "inventory"  # a stale sample is not "now"
    # A virtual device has no temperature or power: unknown, never 0.
    assert rows[0]["temperature_c"] is None and rows[0]["power_w"] is None
    card = dev.card(rows[0])
    assert (card["temperature"], card["power"], card["utilization"]) == ("—", "—", "42%")
    assert card["virtual"] and card["badge"][0] == "idle"
    assert 0.0 <= card["memory_fraction"] <= 1.0


@pytest.mark.slow
def test_cli_info_still_reads_devices_through_status(state_home):
    result = run_cli("info", "--json", module="scheduler", env={"SAE_DIST_VIRTUAL_GPUS": "3"})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["uuid"] for r in rows] == ["virtual-0", "virtual-1", "virtual-2"]
    assert {r["state"] for r in rows} == {"idle"} and rows[0]["temperature_c"] is None


# ---- the queue ----

def test_queue_overview_counts_pending_running_and_finished():
    engine = get_engine()
    now = utcnow()
    low = command_job(engine, "low")
    high = command_job(engine, "high", priority=5)
    held = command_job(engine, "held", held=True)
    train = running_job(engine, ["virtual-0", "virtual-1"], kind="train", name="trainer",
                        started=now - timedelta(seconds=70))
    t0 = now - timedelta(seconds=60)
    # Steps 10..300 logged over 58 s: 290 steps in 58 s, 5 steps/s; 2,700 to go from 2 s ago.
    training_run(engine, train, 3000, [(10, t0), (300, t0 + timedelta(seconds=58))])
    limited = running_job(engine, ["virtual-2"], name="limited", time_limit_s=600.0,
                          started=now - timedelta(seconds=150))
    done = running_job(engine, ["virtual-3"], name="done")
    finish_job(engine, done, "COMPLETED", exit_code=0, now=now - timedelta(seconds=30))
    failed = command_job(engine, "failed")
    start_jobs(engine, [(failed, ("virtual-3",))], {}, now=now - timedelta(seconds=20))
    finish_job(engine, failed, "FAILED", exit_code=3, now=now - timedelta(seconds=10))

    q = status.queue_overview(engine, now)
    assert q["counts"] == {"PENDING": 3, "RUNNING": 2, "held": 1}
    assert [j["id"] for j in q["pending"]] == [high, low, held]  # start order: priority, then id
    assert q["pending"][2]["held"] and q["pending"][2]["reason"] == "JobHeldUser"
    assert q["total_jobs"] == 7

    by_id = {j["id"]: j for j in q["running"]}
    trained = by_id[train]
    assert (trained["basis"], trained["step"], trained["total_steps"]) == ("steps", 300, 3000)
    assert trained["fraction"] == pytest.approx(0.1)
    assert trained["eta_s"] == pytest.approx(2700 / 5 - 2, abs=1)
    assert trained["devices"] == ["virtual-0", "virtual-1"] and trained["run_id"] is not None
    timed = by_id[limited]
    assert timed["basis"] == "time" and timed["fraction"] == pytest.approx(150 / 600, abs=0.01)

    assert [(j["id"], j["state"], j["exit_code"]) for j in q["finished"]] == [
        (failed, "FAILED", 3), (done, "COMPLETED", 0)]  # newest first
    assert q["finished"][0]["elapsed_s"] == pytest.approx(10, abs=0.1)


def test_progress_of_each_kind_of_job():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    started = now - timedelta(minutes=2)
    starting = status.progress("train", started, now, None, None, 500)
    assert (starting["basis"], starting["fraction"], starting["step"]) == ("starting", 0.0, 0)
    assert starting["elapsed_s"] == 120

    run = {"last_step": 100, "first_step": 10, "last_logged_step": 100,
           "first_time": now - timedelta(seconds=100), "last_time": now - timedelta(seconds=10)}
    steps = status.progress("train", started, now, None, run, 1000)
    assert steps["fraction"] == 0.1 and steps["eta_s"] == pytest.approx(900 - 10)  # 1 step/s
    # The ETA counts from the last logged step: a run silent for two hours is overdue, never negative.
    quiet = dict(run, first_time=now - timedelta(seconds=7290), last_time=now - timedelta(hours=2))
    assert status.progress("train", started, now, None, quiet, 1000)["eta_s"] == 0.0
    one_step = dict(run, first_step=100)
    assert status.progress("train", started, now, None, one_step, 1000)["eta_s"] is None

    assert status.progress("command", started, now, 240.0, None, None)["fraction"] == 0.5
    free = status.progress("command", started, now, None, None, None)
    assert (free["basis"], free["fraction"]) == ("elapsed", None)


# ---- submitting ----

def test_ensure_daemon_starts_none_when_autostart_is_off():
    assert ensure_daemon() is False
    assert not daemon_running()


def test_demo_job_takes_two_free_devices_then_one_then_any():
    engine = get_engine()
    job_id, chosen = submit_demo(engine, str(REPO))
    job = get_job(engine, job_id)
    assert (job.state, job.kind, job.gpus) == ("PENDING", "train", DEMO_DEVICES)
    assert json.loads(job.gpu_ids_json) == chosen and len(chosen) == DEMO_DEVICES
    config = json.loads(job.train_config_json)
    assert (config["source"], config["d_in"], config["k"], config["steps"]) == ("synthetic", 64, 8, 3000)
    assert config["name"] == job.name and job.name.startswith("demo-")
    assert json.loads(job.argv_json) == []
    assert not daemon_running()

    running_job(engine, ["virtual-0", "virtual-1", "virtual-2"])
    job_id, chosen = submit_demo(engine, str(REPO))
    assert chosen == ["virtual-3"] and json.loads(get_job(engine, job_id).gpu_ids_json) == chosen

    running_job(engine, ["virtual-3"])
    job_id, chosen = submit_demo(engine, str(REPO))
    job = get_job(engine, job_id)
    assert chosen == [] and job.gpu_ids_json is None and job.gpus == 1  # waits for any one


# ---- presentation of devices (pure) ----

def row(uuid="virtual-0", state="idle", **fields) -> dict:
    base = {"index": 0, "uuid": uuid, "name": "Virtual GPU 0 (CPU-backed)", "label": "virtual GPU 0",
            "virtual": True, "state": state, "job_id": None, "reason": "free", "error": None,
            "memory_total": 8 * 2**30, "memory_used": 2 * 2**30, "memory_free": 6 * 2**30,
            "utilization_pct": None, "temperature_c": None, "power_w": None, "power_limit_w": None}
    return {**base, **fields}


def test_device_badges_and_selection_rows():
    assert dev.state_badge(row(state="busy", reason="external process 42"))[:2] == ("busy external", "orange")
    assert dev.state_badge(row(state="unavailable", reason="NVML: GPU is lost"))[0] == "unavailable"
    busy = row("GPU-b", state="busy", reason="external process 42", memory_free=0)
    short = row("GPU-s", memory_free=2**30)
    table = dev.selection_rows([row(), busy, short], need_bytes=3 * 2**30, recommended=["virtual-0"])
    ok, blocked, low = table
    assert ok["selectable"] and ok["recommended"] and ok["why"] == "" and not ok["low_memory"]
    assert not blocked["selectable"] and blocked["why"] == "busy: external process 42"
    assert not blocked["low_memory"]  # taken: its memory is not the point
    assert low["selectable"] and low["low_memory"]
    assert low["why"] == "low memory: 1.0 GiB free, 3.0 GiB needed"
    assert ok["memory_text"] == "6.0 GiB free / 8.0 GiB" and ok["utilization"] == "—"
    assert dev.low_memory(row(memory_free=None), 10) is None  # unknown is not "low"
    card = dev.card(row(memory_used=None))
    assert card["memory_fraction"] is None and card["memory_text"] == "— / 8.0 GiB"
    gpu = dev.card(row(virtual=False, temperature_c=64.4, power_w=212.0, power_limit_w=300.0,
                       utilization_pct=97.0))
    assert (gpu["temperature"], gpu["power"], gpu["utilization"]) == ("64 °C", "212 / 300 W", "97%")
    assert gpu["utilization_fraction"] == 0.97 and card["utilization_fraction"] is None


def test_a_shared_devices_badge_names_its_jobs_and_an_over_user():
    from sae_dist.analytics.devices import state_badge

    row = {"state": "allocated", "job_id": 3, "reason": "job 3", "memory_total": 80 * 2**30,
           "sharers": [{"job": 3, "declared": 12 * 2**30, "used": None, "over": False},
                       {"job": 4, "declared": 12 * 2**30, "used": 13 * 2**30, "over": True}]}
    label, color, help_text = state_badge(row)
    assert label == "shared · jobs 3, 4 · OVER" and color == "red"
    assert "job 4: 12.0 GiB declared, uses 13.0 GiB (over)" in help_text and "56.0 GiB left to declare" in help_text

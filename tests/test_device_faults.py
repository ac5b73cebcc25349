"""A device a training rank died on (issue 8): unavailable to new jobs, shown as failed by `info`
and the app, until a health probe passes (`info --recheck`, or the daemon by itself).

The decisions (what a fault does to the inventory, which faults are due a probe, which job
waits on a failed device) are tested on plain data; the rest for real: a SQLite database in a
temporary home, 3 virtual devices, real daemon, CLI and probe processes, Streamlit AppTest.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from sqlmodel import Session, select
from streamlit.testing.v1 import AppTest

from conftest import REPO, kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from sae_dist.contract import KILL_RANK_AT_ENV
from sae_dist.db import DeviceFault, active_faults, get_engine, record_fault
from sae_dist.errors import UserError
from scheduler import status
from scheduler.busy import classify
from scheduler.devices import DeviceInfo
from scheduler.faults import (
    CLEARED_REASON,
    RECHECK_ENV_VAR,
    Fault,
    apply_faults,
    faults_by_device,
    faults_due,
    recheck_interval_s,
)
from scheduler.health import ProbeResult, probe_all, probe_command, verdict
from scheduler.policy import DeviceView, JobView, plan
from scheduler.recommend import recommend
from scheduler.store import NewJob, get_job, submit

DEVICES = 3
UUIDS = [f"virtual-{i}" for i in range(DEVICES)]
T0 = datetime(2026, 1, 2, 10, 0, 3, tzinfo=timezone.utc)
NO_SUCH_GPU = "GPU-00000000-0000-0000-0000-000000000000"
WAITING_ON_2 = "ReqNodeNotAvail, UnavailableNodes:virtual-2"


@pytest.fixture(autouse=True)
def virtual_devices(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", str(DEVICES))
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")  # tests start their daemon themselves
    monkeypatch.setenv("SAE_DIST_KILL_GRACE_S", "3")
    monkeypatch.delenv(RECHECK_ENV_VAR, raising=False)


def virtual(i: int, **fields) -> DeviceInfo:
    return DeviceInfo(index=i, uuid=f"virtual-{i}", name=f"Virtual GPU {i}", virtual=True, **fields)


def fault_row(uuid: str, detected: datetime, fault_id: int = 1, **fields) -> SimpleNamespace:
    """What `active_faults` returns, as plain data."""
    values = {"id": fault_id, "device_uuid": uuid, "reason": "CUDA error: an illegal memory access",
              "job_id": 7, "run_id": 3, "rank": 1, "detected_at": detected, **fields}
    return SimpleNamespace(**values)


def fault(uuid: str = "virtual-2", since: datetime = T0, latest: datetime | None = None) -> Fault:
    return Fault(device_uuid=uuid, reason="NCCL timeout", since=since, latest=latest or since, job_id=7, rank=1)


# ---- the decisions, on plain data ----

def test_a_fault_makes_its_device_unavailable_with_job_rank_and_since():
    rows = [fault_row("virtual-2", T0, 1), fault_row("virtual-2", T0 + timedelta(hours=1), 2, job_id=9,
                                                     reason="later")]
    faults = faults_by_device(rows)
    assert set(faults) == {"virtual-2"}
    one = faults["virtual-2"]
    assert (one.job_id, one.rank, one.since, one.latest) == (7, 1, T0, T0 + timedelta(hours=1))
    expected = "failed in job 7 (rank 1) since 2026-01-02 10:00:03 UTC: CUDA error: an illegal memory access"
    assert one.describe() == expected
    assert one.as_dict()["since"] == "2026-01-02T10:00:03+00:00" and one.as_dict()["run_id"] == 3

    unreadable = virtual(1, available=False, error="power: Unknown Error")
    devices = apply_faults([virtual(0), unreadable, virtual(2)], faults | {"virtual-1": fault("virtual-1")})
    assert devices[0] == virtual(0)  # untouched
    assert devices[1].error.startswith("failed in job 7 (rank 1)")
    assert devices[1].error.endswith("; power: Unknown Error")  # the fault first, the read error kept
    assert not devices[2].available and devices[2].fault is one and devices[2].error == expected
    states = classify(devices, {}, {}, set(), now=0.0)
    assert states["virtual-0"].state == "idle"
    assert (states["virtual-2"].state, states["virtual-2"].reason) == ("unavailable", expected)
    # A failed device still held by the job it failed in reads failed, not allocated.
    held = classify(devices, {"virtual-2": 7}, {7: 0.0}, set(), now=0.0)
    assert held["virtual-2"].state == "unavailable"
    # `recommend` (the CLI's and the app's choice) passes over it, saying why.
    advice = recommend(devices, states, 1, None)
    assert advice.chosen == ["virtual-0"] and advice.passed_over["virtual-2"] == f"unavailable: {expected}"

    without_job = Fault(device_uuid="GPU-x", reason="lost", since=T0, latest=T0)
    assert without_job.describe() == "failed since 2026-01-02 10:00:03 UTC: lost"


def test_which_faults_are_due_a_health_probe():
    now = T0.timestamp()
    faults = {"virtual-0": fault("virtual-0", T0 - timedelta(seconds=300)),  # old enough
              "virtual-1": fault("virtual-1", T0 - timedelta(seconds=10)),  # just failed
              "virtual-2": fault("virtual-2", T0 - timedelta(hours=1), latest=T0 - timedelta(seconds=5)),
              "GPU-a": fault("GPU-a", T0 - timedelta(hours=1))}
    assert faults_due(faults, {}, now, 300) == ["GPU-a", "virtual-0"]  # virtual-2 failed again lately
    assert faults_due(faults, {"GPU-a": now - 299}, now, 300) == ["virtual-0"]  # probed 299 s ago
    assert faults_due(faults, {"GPU-a": now - 300}, now, 300) == ["GPU-a", "virtual-0"]
    assert faults_due(faults, {}, now, 300, probing={"virtual-0"}) == ["GPU-a"]  # one probe at a time
    assert faults_due(faults, {}, now, 1) == ["GPU-a", "virtual-0", "virtual-1", "virtual-2"]
    assert faults_due({}, {}, now, 1) == []


@pytest.mark.parametrize("raw, expected", [(None, 300.0), ("", 300.0), ("60", 60.0), (" 0.5 ", 0.5)])
def test_the_recheck_interval_from_the_environment(raw, expected):
    environ = {} if raw is None else {RECHECK_ENV_VAR: raw}
    assert recheck_interval_s(environ) == expected


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "nan", "inf", "5 min"])
def test_a_bad_recheck_interval_is_one_clear_error(raw):
    with pytest.raises(UserError) as error:
        recheck_interval_s({RECHECK_ENV_VAR: raw})
    assert str(error.value).startswith(f"{RECHECK_ENV_VAR}={raw!r}: ") and "above 0" in str(error.value)


def test_the_policy_keeps_jobs_off_a_failed_device_and_names_it():
    devices = [DeviceView(uuid=u, index=i, free=u != "virtual-2", unavailable=u == "virtual-2")
               for i, u in enumerate(UUIDS)]
    three = JobView(id=1, gpus=3, priority=10)  # first in line, but cannot run without virtual-2
    exact = JobView(id=2, gpus=1, gpu_ids=("virtual-2",), priority=5)
    two = JobView(id=3, gpus=2)  # no time limit: would be kept off a reservation's devices
    p = plan([three, exact, two], [], devices, {}, now=0.0)
    assert p.starts == [(3, ("virtual-0", "virtual-1"))]
    assert p.reasons == {1: WAITING_ON_2, 2: WAITING_ON_2}
    assert p.reservation is None  # waiting on a failed device holds nobody up

    # With every available device busy, a job that fits on them waits for Resources as before.
    busy = [DeviceView(uuid=d.uuid, index=d.index, free=False, unavailable=d.unavailable) for d in devices]
    running = [JobView(id=9, gpus=2, devices=("virtual-0", "virtual-1"), started_at=0.0, time_limit_s=60)]
    p = plan([JobView(id=4, gpus=2)], running, busy, {}, now=0.0)
    assert p.reasons == {4: "Resources"} and p.reservation.devices == ("virtual-0", "virtual-1")


def test_the_probe_command_and_its_verdict():
    argv, env = probe_command("virtual-1", {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"})
    assert argv[1:] == ["-m", "scheduler.probe", "virtual-1"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PATH"] == "/bin"  # a virtual device touches no GPU
    _, env = probe_command(NO_SUCH_GPU, {})
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == (NO_SUCH_GPU, "PCI_BUS_ID")

    assert verdict("virtual-1", "some warning\nHEALTHY\n").healthy
    sick = verdict("GPU-a", "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error: unknown error\n")
    assert not sick.healthy and sick.detail == "RuntimeError: CUDA error: unknown error"
    assert verdict("GPU-a", "").detail == "the probe ended without a word"


@pytest.mark.slow
def test_real_probes_pass_fail_and_time_out():
    healthy, gone = probe_all(["virtual-0", NO_SUCH_GPU])
    assert healthy == ProbeResult("virtual-0", True, CLEARED_REASON)
    assert not gone.healthy and gone.detail  # NVML cannot find it (or there is no NVML at all)
    # Python and torch take far longer to start than this: the probe is killed, and fails.
    [late] = probe_all(["virtual-1"], timeout_s=0.01)
    assert late == ProbeResult("virtual-1", False, "no answer within 0.01 s")


# ---- for real: the database, info, the daemon, the probes ----

@pytest.mark.slow
def test_info_shows_a_failed_device_with_its_job_rank_and_since():
    engine = get_engine()
    record_fault(engine, "virtual-2", "RuntimeError: CUDA error: an illegal memory access",
                 job_id=7, run_id=3, rank=1)
    devices, states, _ = status.devices_now(engine)
    assert [d.available for d in devices] == [True, True, False]
    rows = status.device_rows(devices, states, {})
    assert rows[0]["fault"] is None and rows[2]["state"] == "unavailable"
    assert rows[2]["reason"].startswith("failed in job 7 (rank 1) since ")

    text, as_json = run_cli("info", module="scheduler"), run_cli("info", "--json", module="scheduler")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    failed = json.loads(as_json.stdout)[2]
    assert (failed["uuid"], failed["state"]) == ("virtual-2", "unavailable")
    assert {k: failed["fault"][k] for k in ("job_id", "run_id", "rank")} == {"job_id": 7, "run_id": 3, "rank": 1}
    since = datetime.fromisoformat(failed["fault"]["since"])
    assert abs((since - datetime.now(timezone.utc)).total_seconds()) < 600
    assert failed["reason"] == failed["fault"]["description"]
    assert failed["fault"]["reason"] == "RuntimeError: CUDA error: an illegal memory access"
    lines = text.stdout.splitlines()[1:]
    assert [state_column(line) for line in lines] == ["idle", "idle", "failed"]
    assert "failed in job 7 (rank 1) since " in lines[2] and "illegal memory access" in lines[2]


def state_column(info_line: str) -> str:
    """The STATE of a line of `info` about a virtual device (its name is 4 words)."""
    return info_line.split()[6]  # ID, "Virtual GPU i (CPU-backed)", KIND, STATE


@pytest.fixture
def daemons(state_home):
    """Start real daemons for the test; stop them, and whatever job they left, afterwards."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        state_home.mkdir(parents=True, exist_ok=True)
        proc = start_daemon(state_home / "daemon-test.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc)
    kill_running_jobs()


def command(*argv: str, gpus: int = 1, gpu_ids: list[str] | None = None, name: str = "job") -> NewJob:
    return NewJob(name=name, kind="command", argv=list(argv), gpus=len(gpu_ids) if gpu_ids else gpus,
                  gpu_ids=gpu_ids, workdir=str(REPO))


def wait_state(job_id: int, state: str, timeout: float = 90):
    wait_for(lambda: get_job(get_engine(), job_id).state == state, timeout, f"job {job_id} to be {state}")
    return get_job(get_engine(), job_id)


def faults_of(uuid: str) -> list[DeviceFault]:
    with Session(get_engine()) as session:
        return list(session.exec(select(DeviceFault).where(DeviceFault.device_uuid == uuid)))


@pytest.mark.slow
def test_the_daemon_schedules_around_a_failed_device_and_info_recheck_clears_it(daemons, monkeypatch):
    engine = get_engine()
    record_fault(engine, "virtual-2", "rank 1 died: SIGKILL", job_id=7, rank=1)
    record_fault(engine, NO_SUCH_GPU, "fell off the bus", job_id=7, rank=2)  # never healthy again
    three = submit(engine, command("true", gpus=3, name="three"))
    exact = submit(engine, command("true", gpu_ids=["virtual-2"], name="exact"))
    two = submit(engine, command("true", gpus=2, name="two"))
    monkeypatch.setenv(RECHECK_ENV_VAR, "3600")  # the daemon makes no health check of its own here
    daemons()

    ran = wait_state(two, "COMPLETED")
    assert json.loads(ran.devices_json) == ["virtual-0", "virtual-1"]  # never the failed one
    for job_id in (three, exact):
        wait_for(lambda: get_job(engine, job_id).reason == WAITING_ON_2, 30, f"job {job_id}'s reason")
        assert get_job(engine, job_id).state == "PENDING"
    queue = json.loads(run_cli("queue", "--json", module="scheduler").stdout)
    assert {r["job_id"]: r["reason"] for r in queue} == {three: WAITING_ON_2, exact: WAITING_ON_2}

    result = run_cli("info", "--recheck", module="scheduler")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{NO_SUCH_GPU}: still failing: ")
    assert lines[1] == "virtual-2: health check passed, fault cleared"
    assert {state_column(line) for line in lines[-DEVICES:]} <= {"idle", "allocated"}  # jobs may start
    [cleared] = faults_of("virtual-2")
    assert cleared.cleared_at is not None and cleared.cleared_reason == CLEARED_REASON
    assert [f.device_uuid for f in active_faults(engine)] == [NO_SUCH_GPU]  # a failed probe keeps it

    assert len(json.loads(wait_state(three, "COMPLETED").devices_json)) == 3
    assert json.loads(wait_state(exact, "COMPLETED").devices_json) == ["virtual-2"]

    again = run_cli("info", "--recheck", "--json", module="scheduler")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert [(r["uuid"], r["cleared"]) for r in report["rechecked"]] == [(NO_SUCH_GPU, False)]
    assert [d["state"] for d in report["devices"]] == ["idle"] * DEVICES


@pytest.mark.slow
def test_the_daemon_clears_a_healthy_device_by_itself(daemons, state_home, monkeypatch):
    engine = get_engine()
    record_fault(engine, "virtual-1", "rank 1 died: SIGKILL", job_id=3, rank=1)
    exact = submit(engine, command("true", gpu_ids=["virtual-1"], name="exact"))
    monkeypatch.setenv(RECHECK_ENV_VAR, "0.5")
    daemons()
    wait_for(lambda: not active_faults(engine), 120, "the daemon's health check to clear the fault")
    [cleared] = faults_of("virtual-1")
    assert cleared.cleared_reason == CLEARED_REASON
    assert json.loads(wait_state(exact, "COMPLETED").devices_json) == ["virtual-1"]
    log = (state_home / "daemon-test.log").read_text()
    assert "virtual-1: health check passed" in log


@pytest.mark.slow
@pytest.mark.parametrize("raw", ["abc", "0"])
def test_a_bad_recheck_interval_stops_the_daemon_with_one_line(raw):
    result = run_cli("daemon", module="scheduler", env={RECHECK_ENV_VAR: raw}, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {RECHECK_ENV_VAR}={raw!r}: ") and result.stderr.count("\n") == 1


# ---- the app ----

def app_page(page: str | None = None) -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=30).run()
    assert not at.exception
    if page is not None:
        at.switch_page(page).run()
        assert not at.exception
    return at


@pytest.mark.slow
def test_the_app_shows_a_failed_device_and_it_cannot_be_picked():
    record_fault(get_engine(), "virtual-2", "NCCL watchdog timeout", job_id=7, rank=1)
    at = app_page()
    markdown = [m.value for m in at.markdown]
    assert markdown.count(":green-badge[idle]") == 2 and ":red-badge[failed]" in markdown
    [note] = [c.value for c in at.caption if c.value.startswith("Unavailable: failed")]
    assert "job 7 (rank 1)" in note and "NCCL watchdog timeout" in note and "--recheck" in note

    at = app_page("pages/1_Train.py")
    box = at.checkbox(key="tr_dev_virtual-2")
    assert box.disabled and box.value is False
    assert box.proto.help.startswith("unavailable: failed in job 7 (rank 1) since ")
    assert [u for u in UUIDS if at.checkbox(key=f"tr_dev_{u}").value] == ["virtual-0", "virtual-1"]
    markdown = [m.value for m in at.markdown]
    assert ":red-badge[failed]" in markdown
    assert any("failed in job 7 (rank 1)" in m and "NCCL watchdog timeout" in m for m in markdown)


@pytest.mark.slow
def test_a_training_job_that_loses_a_rank_finishes_and_its_device_is_marked_failed(daemons, tmp_path, monkeypatch):
    """The whole path: a 3-GPU training job through the daemon, rank 2 SIGKILLed mid-run (it kills
    itself after step 6: KILL_RANK_AT_ENV). The job continues on 2 from its step-4 checkpoint and
    COMPLETES; virtual-2 is failed in `info` (job and rank), new jobs go around it, and
    `info --recheck` brings it back."""
    monkeypatch.setenv(RECHECK_ENV_VAR, "3600")
    out_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(f'd_in = 32\nd_sae = 128\nk = 8\nsteps = 8\nlog_every = 2\ncheckpoint_every = 4\n'
                      f'batch_size = 128\nout_dir = "{out_dir}"\n')
    submitted = run_cli("submit", "--train", str(config), "-G", "3", "--env", f"{KILL_RANK_AT_ENV}=2:6",
                        "--json", module="scheduler")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    daemons()
    done = wait_state(job_id, "COMPLETED", timeout=180)
    assert json.loads(done.devices_json) == ["virtual-0", "virtual-1", "virtual-2"]

    [fault] = active_faults(get_engine())
    assert (fault.device_uuid, fault.job_id, fault.rank) == ("virtual-2", job_id, 2)
    info = run_cli("info", module="scheduler").stdout
    line = next(li for li in info.splitlines() if "Virtual GPU 2" in li)
    assert state_column(line) == "failed" and f"job {job_id}" in info
    result = run_cli("info", "--recheck", module="scheduler")
    assert "virtual-2: health check passed, fault cleared" in result.stdout
    assert active_faults(get_engine()) == []

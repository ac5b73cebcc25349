"""The scheduler on an emulated 8-GPU A100 machine: the real daemon, CLI, supervisor and health
probe processes, the real nvidia-ml-py, and libnvidia-ml.so.1 from tests/fake_nvml found through
LD_LIBRARY_PATH (no SAE_DIST_VIRTUAL_GPUS). Changes on the "hardware" are the scenario file
rewritten; every wait is for a state, never for a time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fake_nvml
from conftest import REPO, kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from fake_nvml import CPU_TORCH
from sae_dist.db import active_faults, get_engine
from scheduler.faults import RECHECK_ENV_VAR
from scheduler.store import get_job

GIB = fake_nvml.GIB
ORDERED = fake_nvml.in_bus_order(fake_nvml.eight_a100s())
UUIDS = [d["uuid"] for d in ORDERED]  # by the index the product must give each


@pytest.fixture
def machine(fake_nvml_lib, tmp_path, monkeypatch, state_home):
    """This test's processes see the emulated A100s; returns a function writing the scenario
    (a dict, or a function of the 8 devices in PCI bus order that changes them)."""
    path = tmp_path / "scenario.json"
    fake_nvml.write(path, fake_nvml.eight_a100s())
    for key, value in fake_nvml.environment(fake_nvml_lib, path, base={}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SAE_DIST_VIRTUAL_GPUS", raising=False)
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")  # tests start their daemon themselves
    monkeypatch.setenv("SAE_DIST_KILL_GRACE_S", "3")
    monkeypatch.delenv(RECHECK_ENV_VAR, raising=False)

    def write(change=None) -> dict:
        scenario = fake_nvml.eight_a100s()
        if change is not None:
            by_bus = fake_nvml.in_bus_order(scenario)  # the same dicts, in index order
            change(by_bus)
        fake_nvml.write(path, scenario)
        return scenario

    return write


@pytest.fixture
def daemon(state_home):
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        state_home.mkdir(parents=True, exist_ok=True)
        started.append(start_daemon(state_home / "daemon-test.log"))
        return started[-1]

    yield start
    for proc in started:
        stop_process(proc)
    kill_running_jobs()


def cli(*args: str) -> subprocess.CompletedProcess:
    out = run_cli(*args, module="scheduler")
    assert out.returncode == 0, out.stderr
    return out


def info() -> list[dict]:
    return json.loads(cli("info", "--json").stdout)


def submit(*args: str) -> int:
    return json.loads(cli("submit", "--json", *args).stdout)["job_id"]


def wait_state(job_id: int, state: str, timeout: float = 90):
    wait_for(lambda: get_job(get_engine(), job_id).state == state, timeout, f"job {job_id} to be {state}")
    return get_job(get_engine(), job_id)


def job_pid(job_id: int, timeout: float = 90) -> int:
    """The job's process id, once its supervisor has recorded it: a job is RUNNING from the moment
    its devices are allocated, before its process exists (a scenario naming pid None is a bad one,
    and the emulated driver then fails every call)."""
    return wait_for(lambda: get_job(get_engine(), job_id).pid, timeout, f"job {job_id}'s process")


def test_info_lists_the_eight_a100s_in_pci_bus_order_with_their_readings(machine):
    def readings(d):
        d[0].update(memory_used=10 * GIB, utilization=55, temperature=64, power_w=250.4)
        d[5]["errors"] = {"temperature": "NOT_SUPPORTED", "power": "NOT_SUPPORTED"}
    machine(readings)
    rows = info()
    assert [(r["index"], r["uuid"], r["name"]) for r in rows] == [(i, u, fake_nvml.A100) for i, u in enumerate(UUIDS)]
    first, unsupported = rows[0], rows[5]
    assert (first["memory_total"], first["memory_used"], first["utilization_pct"]) == (80 * GIB, 10 * GIB, 55.0)
    assert (first["temperature_c"], first["power_w"], first["virtual"], first["state"]) == (64.0, 250.4, False, "busy")
    assert first["reason"] == "10240 MiB in use by something else"  # memory used, no process listed
    assert (unsupported["temperature_c"], unsupported["power_w"], unsupported["state"]) == (None, None, "idle")
    assert [r["state"] for r in rows[1:]] == ["idle"] * 7

    text = [re.split(r"\s{2,}", line.strip()) for line in cli("info").stdout.splitlines()]
    assert text[0] == ["ID", "NAME", "KIND", "STATE", "MEMORY", "UTIL", "TEMP", "POWER", "JOB/REASON"]
    assert text[1] == ["0", fake_nvml.A100, "gpu", "busy", "10.0 GiB / 80.0 GiB", "55%", "64C", "250W",
                       "10240 MiB in use by something else"]
    assert text[6] == ["5", fake_nvml.A100, "gpu", "idle", "0 B / 80.0 GiB", "0%", "—", "—"]  # unknown, never 0


@pytest.mark.slow
def test_jobs_get_the_gpus_by_the_index_info_shows_in_cuda_pci_order(machine, daemon, tmp_path):
    machine()
    daemon()
    seen = {}
    for label, args in (("two", ["-G", "2"]), ("exact", ["--gpu-ids", "3,6"]), ("all", ["-G", "8"])):
        out = tmp_path / f"{label}.env"
        job_id = submit(*args, "--", "sh", "-c", f'echo "$CUDA_DEVICE_ORDER|$CUDA_VISIBLE_DEVICES" > {out}')
        done = wait_state(job_id, "COMPLETED")
        order, visible = out.read_text().strip().split("|")
        seen[label] = (order, visible.split(","), json.loads(done.devices_json))
    assert seen["two"] == ("PCI_BUS_ID", UUIDS[:2], UUIDS[:2])  # the two lowest bus ids: CUDA's 0 and 1
    assert seen["exact"] == ("PCI_BUS_ID", [UUIDS[3], UUIDS[6]], [UUIDS[3], UUIDS[6]])
    assert seen["all"] == ("PCI_BUS_ID", UUIDS, UUIDS)


@pytest.mark.slow
def test_a_foreign_process_makes_a_gpu_busy_until_it_leaves(machine, daemon, tmp_path):
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        def on_three(d):
            d[3].update(memory_used=6 * GIB, processes=[{"pid": stranger.pid, "used_memory": 6 * GIB}])
            d[5].update(processes=[{"pid": 4190000, "used_memory": GIB}])  # another container's: no /proc
        machine(on_three)
        rows = info()
        assert (rows[3]["state"], rows[3]["reason"]) == ("busy", f"used by pid {stranger.pid}, not a scheduler job")
        assert (rows[5]["state"], rows[5]["reason"]) == ("busy", "used by pid 4190000, not a scheduler job")
        daemon()
        whole = submit("-G", "8", "--", "true")
        most = submit("-G", "6", "-t", "30", "--", "sleep", "600")  # a time limit: it may backfill
        running = wait_state(most, "RUNNING")
        assert json.loads(running.devices_json) == [u for i, u in enumerate(UUIDS) if i not in (3, 5)]
        assert get_job(get_engine(), whole).state == "PENDING"
        cli("cancel", str(most))
        wait_state(most, "CANCELLED")
        assert get_job(get_engine(), whole).state == "PENDING"  # devices 3 and 5 are still used
    finally:
        stranger.kill()
        stranger.wait()
    machine()  # the driver no longer lists them
    assert json.loads(wait_state(whole, "COMPLETED").devices_json) == UUIDS
    assert [r["state"] for r in info()] == ["idle"] * 8


@pytest.mark.slow
def test_a_jobs_own_process_is_its_own_on_its_gpu_and_busy_elsewhere(machine, daemon):
    machine()
    daemon()
    job = submit("--gpu-ids", "0", "--", "sleep", "600")
    wait_state(job, "RUNNING")
    pid = job_pid(job)

    def listed(d):  # the driver lists the job's process on its GPU, and on one it was not given
        d[0].update(memory_used=GIB, processes=[{"pid": pid, "used_memory": GIB}])
        d[4].update(memory_used=GIB, processes=[{"pid": pid, "used_memory": GIB}])
    machine(listed)
    rows = info()
    assert (rows[0]["state"], rows[0]["reason"]) == ("allocated", f"job {job}")
    assert (rows[4]["state"], rows[4]["reason"]) == (
        "busy", f"used by pid {pid} of a scheduler job, outside the devices it was given")
    assert [r["state"] for i, r in enumerate(rows) if i not in (0, 4)] == ["idle"] * 6


def test_recommend_uses_the_free_memory_nvml_reports(machine):
    def used(d):
        for i, gib in enumerate([70, 10, 30, 0, 79, 5, 20, 40]):
            d[i]["memory_used"] = gib * GIB
        for i in range(8):
            d[i]["processes"] = []  # memory in use without a process: busy beyond 512 MiB
    machine(used)
    # Every device but 3 is busy from memory alone; recommend names why it passes each over.
    advice = json.loads(cli("recommend", "--count", "1", "--mem", "60GiB", "--json").stdout)
    assert advice["chosen"] == [UUIDS[3]] and advice["error"] is None
    assert advice["passed_over"][UUIDS[4]].startswith("busy: 80896 MiB in use by something else")

    def small(d):  # used memory below the threshold (driver contexts): free to use
        for i, mib in enumerate([500, 100, 300, 0, 400, 50, 200, 450]):
            d[i]["memory_used"] = mib * 2**20
    machine(small)
    advice = json.loads(cli("recommend", "--count", "3", "--json").stdout)
    assert advice["chosen"] == [UUIDS[3], UUIDS[5], UUIDS[1]]  # the most free memory first
    lines = cli("recommend", "--count", "2").stdout.splitlines()
    assert lines[0].startswith(f"use    3  {fake_nvml.A100}  (80.0 GiB free)")


@pytest.mark.slow
@CPU_TORCH
def test_a_gpu_lost_under_a_job_is_failed_until_the_probe_sees_it_back(machine, daemon, monkeypatch):
    machine()
    monkeypatch.setenv(RECHECK_ENV_VAR, "1")
    daemon()
    job = submit("--gpu-ids", "2", "--", "sleep", "600")
    wait_state(job, "RUNNING")

    def lost(d):
        d[2]["errors"] = {"all": "GPU_IS_LOST"}
    machine(lost)
    [fault] = wait_for(lambda: active_faults(get_engine()), 60, "the lost GPU's fault")
    assert (fault.device_uuid, fault.job_id, fault.reason) == (UUIDS[2], job, "NVML: handle: GPU is lost")
    rows = info()
    assert rows[2]["uuid"] == UUIDS[2] and rows[2]["state"] == "unavailable" and rows[2]["fault"]["job_id"] == job
    assert rows[2]["reason"].startswith(f"failed in job {job} since ")
    waiting = submit("--gpu-ids", "2", "--", "true")
    log = Path(get_engine().url.database).parent / "daemon-test.log"
    wait_for(lambda: "still failing its health check" in log.read_text(), 120, "a probe to fail on the lost GPU")
    assert get_job(get_engine(), waiting).state == "PENDING" and active_faults(get_engine())

    machine()  # the GPU answers again
    wait_for(lambda: not active_faults(get_engine()), 120, "the probe to clear the fault")
    [cleared] = [f for f in _faults(UUIDS[2])]
    assert cleared.cleared_reason.startswith("health check passed (checked: NVML only (torch ")
    cli("cancel", str(job))
    wait_state(waiting, "COMPLETED")


@pytest.mark.slow
def test_nvml_failing_under_the_daemon_leaves_gpus_unavailable_never_virtual(machine, daemon):
    machine()
    daemon()
    wait_for(lambda: _device_rows() == UUIDS, 60, "the daemon's inventory")
    fake_nvml.write(Path(_scenario_path()), '{"devices": [')  # the driver breaks
    job = submit("-G", "1", "--", "true")
    wait_for(lambda: "the GPUs are unavailable" in _daemon_log(), 60, "the daemon to notice")
    assert _device_rows() == UUIDS  # no virtual device appears in the GPUs' place
    assert get_job(get_engine(), job).state == "PENDING"
    machine()
    wait_state(job, "COMPLETED")


ONE_PASS = ("import json; from scheduler.daemon import Daemon; from sae_dist.db import get_engine\n"
            "print(json.dumps(Daemon(get_engine()).scheduling_pass()))")


def one_pass() -> list[int]:
    """One whole scheduling pass of a daemon process that never read the GPUs before: what a
    daemon (re)started while NVML is broken does first. Returns the jobs it started."""
    out = subprocess.run([sys.executable, "-c", ONE_PASS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_fresh_info_and_daemon_while_nvml_is_broken_show_the_gpus_unavailable_and_start_nothing(machine):
    machine()
    info()  # a process that saw the GPUs: this host's are kept in the state home
    fake_nvml.write(Path(_scenario_path()), dict(fake_nvml.eight_a100s(), init_error="DRIVER_NOT_LOADED"))
    out = run_cli("info", "--json", module="scheduler")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    why = "NVML did not start: Driver Not Loaded"
    assert [(r["index"], r["uuid"], r["virtual"], r["state"], r["reason"]) for r in rows] == \
        [(i, u, False, "unavailable", why) for i, u in enumerate(UUIDS)]
    assert out.stderr.startswith(f"the GPUs this host listed before are unavailable: {why} (they are kept in ")
    assert len(out.stderr.splitlines()) == 1
    text = cli("info").stdout.splitlines()
    assert len(text) == 9 and all(re.split(r"\s{2,}", line.strip())[2:4] == ["gpu", "unavailable"] for line in text[1:])

    job = submit("-G", "1", "--", "true")
    assert one_pass() == []  # a fresh daemon's pass: no GPU to give, and no virtual device instead
    assert _device_rows() == UUIDS and get_job(get_engine(), job).state == "PENDING"
    machine()  # the driver is back: the same pass starts it on a GPU
    try:
        assert one_pass() == [job]
        assert json.loads(wait_state(job, "COMPLETED").devices_json) == UUIDS[:1]
    finally:
        kill_running_jobs()


def _faults(uuid: str):
    from sqlmodel import Session, select

    from sae_dist.db import DeviceFault

    with Session(get_engine()) as session:
        return list(session.exec(select(DeviceFault).where(DeviceFault.device_uuid == uuid)))


def _device_rows() -> list[str]:
    from sqlmodel import Session, select

    from sae_dist.db import Device

    with Session(get_engine()) as session:
        return [d.uuid for d in session.exec(select(Device).order_by(Device.index))]


def _scenario_path() -> str:
    import os

    return os.environ[fake_nvml.SCENARIO_ENV]


def _daemon_log() -> str:
    from sae_dist.paths import state_home

    path = state_home() / "daemon-test.log"
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_the_app_shows_the_emulated_temperatures_power_and_memory(machine, daemon):
    def readings(d):
        d[0].update(memory_used=10 * GIB, utilization=55, temperature=64, power_w=250.0)
        d[1].update(memory_used=400 * 2**20)  # idle (under the 512 MiB of driver noise), less free
        d[5]["errors"] = {"temperature": "NOT_SUPPORTED", "power": "NOT_SUPPORTED"}
    machine(readings)
    daemon()
    wait_for(lambda: _samples_per_device() >= 2, 60, "two samples of each device")
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fake_nvml" / "app_pages.py"), str(REPO)],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    # The per-device figures, in index (PCI bus) order: temperature 30 + i and power 60 + i W of
    # the scenario's i-th enumerated device, device 0 changed, device 5 without the sensors.
    temps = [64, 33, 35, 32, 36, None, 30, 34]
    power = [250, 63, 65, 62, 66, None, 60, 64]
    overview = [m for m in shown["overview_markdown"] if m.startswith(":small[Temperature")]
    assert overview == [f":small[Temperature **{t} °C** · Power **{p} / 400 W**]" if t is not None
                        else ":small[Temperature **—** · Power **—**]" for t, p in zip(temps, power)]
    assert not any("virtual devices" in c for c in shown["overview_caption"]) and not shown["overview_exception"]

    aggregated = shown["Aggregated"]
    assert not aggregated["exception"] and not aggregated["warning"]
    assert dict(aggregated["metrics"]) == {"Memory used": "10.4 GiB of 640.0 GiB", "Mean utilisation": "7%",
                                           "Total power": f"{sum(p for p in power if p)} W", "Hottest": "64 °C"}
    per_gpu = shown["Per-GPU"]
    assert not per_gpu["exception"] and not per_gpu["warning"]
    titles = [m for m in per_gpu["markdown"] if m.startswith("**GPU ")]
    assert titles == [f"**GPU {i}** · {fake_nvml.A100}" for i in range(8)]
    metrics = per_gpu["metrics"]
    assert [v for label, v in metrics if label == "Temperature"] == [f"{t} °C" if t else "—" for t in temps]
    assert [v for label, v in metrics if label == "Power"] == [f"{p} W" if p else "—" for p in power]
    assert [v for label, v in metrics if label == "Memory"] == ["10.0 GiB", "0.4 GiB"] + ["0.0 GiB"] * 6
    assert [v for label, v in metrics if label == "Utilisation"] == ["55%"] + ["0%"] * 7
    units = per_gpu["chart_units"]  # GPU 5's temperature and power: no sparkline, never one at 0
    assert (units.count("GiB"), units.count("%"), units.count("°C"), units.count("W")) == (8, 8, 7, 7), units
    # The Train page recommends by the free memory NVML reports: not 0 (busy), nor 1 (less free).
    assert shown["train"] == {"exception": [], "checked": [UUIDS[2], UUIDS[3]]}


def _samples_per_device() -> int:
    from sqlalchemy import func, select

    from sae_dist.db import GpuSample

    with get_engine().connect() as conn:
        counts = [n for _, n in conn.execute(select(GpuSample.device_uuid, func.count())
                                             .group_by(GpuSample.device_uuid))]
    return min(counts) if len(counts) == 8 else 0


@CPU_TORCH
def test_info_recheck_says_what_the_probe_could_check(machine):
    """Without CUDA the probe can only ask NVML: `info --recheck` says so beside "passed"."""
    from sae_dist.db import record_fault

    machine()
    record_fault(get_engine(), UUIDS[5], "NVML: handle: GPU is lost")
    done = cli("info", "--recheck")
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith(f"{UUIDS[5]}: health check passed (checked: NVML only (torch "), line
    assert line.endswith(", fault cleared") and not active_faults(get_engine())


def test_shared_jobs_fill_one_gpu_by_declared_memory_and_an_over_user_is_named(machine, daemon, tmp_path):
    """Four --shared jobs of 12 GiB run together on one 80 GB A100 (named by --gpu-ids), a fifth
    of 40 GiB waits naming the memory, an unshared job on it waits for it to empty; a sharer using
    more than it declared (NVML's per-process memory) is named in `info`'s row."""
    machine()
    daemon()
    sharers = [submit("--shared", "--mem", "12GiB", "--gpu-ids", "0", "--", "sleep", "600") for _ in range(4)]
    engine = get_engine()
    wait_for(lambda: all(get_job(engine, j).state == "RUNNING" for j in sharers), 60, "four sharers to run")
    big = submit("--shared", "--mem", "40GiB", "--gpu-ids", "0", "--", "sleep", "600")
    whole = submit("--gpu-ids", "0", "--", "true")
    wait_for(lambda: (get_job(engine, big).reason or "").startswith("Resources, Memory:40.0GiB>"), 60,
             "the fifth to wait for memory")
    wait_for(lambda: get_job(engine, whole).reason == "Resources", 60, "the unshared job to wait for the GPU")
    # NVML's free memory counts too: with 70 GB in use on the card, a 12 GiB sharer waits though the
    # declarations (48 of 80 GiB) leave room.
    machine(lambda d: d[0].update(memory_used=70 * GIB))
    small = submit("--shared", "--mem", "12GiB", "--gpu-ids", "0", "--", "sleep", "600")
    wait_for(lambda: get_job(engine, small).reason == "Resources, Memory:12.0GiB>10.0GiB", 60,
             "a sharer to wait for NVML's free memory")
    pid = job_pid(sharers[0])
    machine(lambda d: d[0].update(memory_used=13 * GIB, processes=[{"pid": pid, "used_memory": 13 * GIB}]))
    row = wait_for(lambda: next((r for r in info() if r["index"] == 0 and r["sharers"] and r["sharers"][0]["over"]),
                                None), 60, "the over-user to be named")
    assert [s["job"] for s in row["sharers"]] == sharers and row["sharers"][0]["used"] == 13 * GIB
    text = cli("info").stdout
    assert f"job {sharers[0]} (12.0 GiB, uses 13.0 GiB: OVER its --mem)" in text and "32.0 GiB of 80.0 GiB left" in text
    assert "(shared)" in cli("queue").stdout
    for j in [*sharers, big, small]:
        cli("cancel", str(j))
    machine()  # the over-user's process gone from the GPU too
    wait_for(lambda: get_job(engine, whole).state == "COMPLETED", 120, "the unshared job once the GPU emptied")
    refused = run_cli("submit", "--shared", "--mem", "100GiB", "--", "true", module="scheduler")
    assert refused.returncode == 2 and "more than any device here has" in refused.stderr, refused.stderr

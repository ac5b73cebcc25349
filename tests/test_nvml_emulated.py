"""The product's NVML code against the real nvidia-ml-py and an emulated driver (tests/fake_nvml).

Every process here finds libnvidia-ml.so.1 through LD_LIBRARY_PATH, as on a GPU machine, and
reads a scenario file; nothing in pynvml or the product is patched. The readings, the error
paths (a sensor the card lacks, a call an old driver lacks, a lost GPU, a bad scenario, no
library at all) and the benchmark's link probe are checked in fresh processes, since a process
loads the library once.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

import fake_nvml
from conftest import REPO
from fake_nvml import CPU_TORCH
from sae_dist.train.balance import initial_weights
from sae_dist.train.free_memory import choose, sources_line
from scheduler import known_gpus
from scheduler.busy import classify
from scheduler.devices import DeviceInfo, in_bus_order, keep_identity, trusted_identities
from scheduler.faults import Fault
from scheduler.health import lost_to_record, verdict

INVENTORY = """
import json, sys
from scheduler.devices import inventory
for path in sys.argv[1:]:
    if path != "-":
        import shutil, os
        shutil.copy(path, os.environ["FAKE_NVML_SCENARIO"] + ".next")
        os.replace(os.environ["FAKE_NVML_SCENARIO"] + ".next", os.environ["FAKE_NVML_SCENARIO"])
    print(json.dumps([d.__dict__ | {"fault": None} for d in inventory()]), flush=True)
"""


def run_python(code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def scenario(tmp_path) -> Path:
    return fake_nvml.write(tmp_path / "scenario.json", fake_nvml.eight_a100s())


@pytest.fixture
def nvml_env(fake_nvml_lib, scenario) -> dict:
    return fake_nvml.environment(fake_nvml_lib, scenario)


def reads(env: dict, *then: dict | str, tmp_path: Path | None = None) -> tuple[list[list[dict]], str]:
    """The inventories one process reads: now, then after each scenario of `then` replaces the
    file (in the same process, so what it remembers between reads counts); and its stderr."""
    files = []
    for i, nxt in enumerate(then):
        files.append(str(fake_nvml.write(Path(env["FAKE_NVML_SCENARIO"]).with_name(f"then{i}.json"), nxt)))
    out = run_python(INVENTORY, env, "-", *files)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()], out.stderr


def test_eight_a100s_are_read_through_the_real_bindings_in_pci_bus_order(nvml_env):
    [devices], stderr = reads(nvml_env)
    expected = fake_nvml.in_bus_order(fake_nvml.eight_a100s())
    assert [d["uuid"] for d in devices] == [e["uuid"] for e in expected]  # not the enumeration order
    assert [d["index"] for d in devices] == list(range(8))
    assert [d["pci_bus_id"] for d in devices] == [e["pci_bus_id"] for e in expected]
    for d, e in zip(devices, expected):
        assert (d["name"], d["virtual"], d["available"], d["error"]) == (fake_nvml.A100, False, True, None)
        assert (d["memory_total"], d["memory_used"], d["memory_free"]) == (80 * fake_nvml.GIB, 0, 80 * fake_nvml.GIB)
        assert (d["temperature_c"], d["power_w"], d["power_limit_w"]) == (e["temperature"], e["power_w"], 400.0)
        assert d["utilization_pct"] == 0.0 and d["processes"] == [] and d["lost"] is False
    assert stderr == ""


def test_readings_processes_and_unsupported_sensors(nvml_env, scenario):
    s = fake_nvml.eight_a100s()
    first = s["devices"][1]  # bus 07: index 0
    first.update(memory_used=3 * fake_nvml.GIB, utilization=87, temperature=71, power_w=312.5,
                 processes=[{"pid": 4242, "used_memory": 2 * fake_nvml.GIB}, {"pid": 4343, "used_memory": None}])
    s["devices"][3]["errors"] = {"temperature": "NOT_SUPPORTED", "power": "NOT_SUPPORTED"}  # bus 0F: index 1
    for key in ("temperature", "power_w", "power_limit_w"):
        del s["devices"][5][key]  # bus 47, index 2: a card without those sensors at all
    fake_nvml.write(scenario, s)
    [devices], stderr = reads(nvml_env)
    zero, one, two = devices[:3]
    assert (zero["memory_used"], zero["memory_free"]) == (3 * fake_nvml.GIB, 77 * fake_nvml.GIB)
    assert (zero["utilization_pct"], zero["temperature_c"], zero["power_w"]) == (87.0, 71.0, 312.5)
    assert zero["processes"] == [[4242, 2 * fake_nvml.GIB], [4343, None]]  # NVML's "not available"
    for d in (one, two):  # unknown, never 0, and the device is not made unavailable by it
        assert (d["temperature_c"], d["power_w"], d["available"], d["error"]) == (None, None, True, None)
    assert one["power_limit_w"] == 400.0 and two["power_limit_w"] is None
    assert stderr == ""


def test_an_old_driver_without_the_newest_calls_uses_the_older_ones(fake_nvml_lib, scenario, tmp_path):
    """nvmlDeviceGetComputeRunningProcesses_v3 and nvmlDeviceGetTemperatureV missing (drivers
    before 525 and 565): the bindings raise, and the product falls back to _v2 and the
    deprecated nvmlDeviceGetTemperature."""
    old = fake_nvml.build(tmp_path / "old", old_driver=True)
    s = fake_nvml.eight_a100s()
    s["devices"][1]["processes"] = [{"pid": 777, "used_memory": 1024}]
    fake_nvml.write(scenario, s)
    [devices], stderr = reads(fake_nvml.environment(old, scenario))
    assert devices[0]["processes"] == [[777, 1024]] and devices[0]["temperature_c"] == 31.0
    assert all(d["available"] for d in devices) and stderr == ""
    missing = run_python("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
                         "try: pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
                         "except pynvml.NVMLLibraryMismatchError: print('mismatch')",
                         fake_nvml.environment(old, scenario))
    assert missing.stdout.strip() == "mismatch", missing.stderr  # what the fallback exists for


def test_memory_the_driver_reserves_for_itself_is_not_use(fake_nvml_lib, scenario, tmp_path):
    """An idle H200 (driver 580) answers the old memory call with 618 MiB used: what the driver
    reserves for itself. Read so, every idle GPU looked used by something else and no job ever
    started (found on the first GPU the project ran on). The versioned call counts only what was
    allocated; a driver without it is read through the old one, reserve and all."""
    from conftest import run_cli

    s = fake_nvml.eight_a100s()
    s["devices"][1]["memory_reserved"] = 618 * 2**20  # bus 07: index 0
    fake_nvml.write(scenario, s)
    env = fake_nvml.environment(fake_nvml_lib, scenario)
    [devices], _ = reads(env)
    assert (devices[0]["memory_used"], devices[0]["memory_free"]) == (0, 80 * fake_nvml.GIB - 618 * 2**20)
    info = run_cli("info", "--json", module="scheduler", env=env)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)[0]["state"] == "idle"
    [old], _ = reads(fake_nvml.environment(fake_nvml.build(tmp_path / "old", old_driver=True), scenario))
    assert old[0]["memory_used"] == 618 * 2**20  # the old call's view: nothing better to be had


def test_a_lost_gpu_keeps_its_identity_and_is_marked_lost(nvml_env, scenario):
    s = fake_nvml.eight_a100s()
    lost = json.loads(json.dumps(s))
    lost["devices"][3]["errors"] = {"all": "GPU_IS_LOST"}  # bus 0F: index 1; fails already at its handle
    flaky = json.loads(json.dumps(s))
    flaky["devices"][3]["errors"] = {"power": "UNKNOWN"}
    (before, after, blip, well), _ = reads(nvml_env, lost, flaky, s)
    assert [d["uuid"] for d in after] == [d["uuid"] for d in before]  # the same device, same place
    one = after[1]
    assert (one["uuid"], one["pci_bus_id"], one["name"]) == (before[1]["uuid"], "00000000:0F:00.0", fake_nvml.A100)
    assert (one["available"], one["lost"], one["error"]) == (False, True, "handle: GPU is lost")
    assert (blip[1]["available"], blip[1]["lost"], blip[1]["error"]) == (False, False, "power: Unknown Error")
    assert well == before


def test_a_gpu_lost_before_the_process_first_looked_is_unknown_not_invented(nvml_env, scenario):
    s = fake_nvml.eight_a100s()
    s["devices"][3]["errors"] = {"handle": "GPU_IS_LOST"}
    fake_nvml.write(scenario, s)
    [devices], _ = reads(nvml_env)
    assert devices[-1]["uuid"] == "unknown-gpu-3" and devices[-1]["lost"]  # NVML index 3, no bus id: last
    assert devices[-1]["available"] is False and devices[-1]["pci_bus_id"] is None


def test_nvml_breaking_after_it_worked_leaves_the_gpus_unavailable_not_virtual(nvml_env, scenario):
    """The driver answering nothing but errors (here: its scenario broken), then failing to
    start again (the session is reopened after a failure), then well."""
    s = fake_nvml.eight_a100s()
    (before, after, again, back), stderr = reads(nvml_env, "{", dict(s, init_error="DRIVER_NOT_LOADED"), s)
    assert [d["uuid"] for d in after] == [d["uuid"] for d in before]
    why = "NVML started but could not count GPUs: Unknown Error"
    assert all(not d["available"] and d["error"] == why for d in after)
    assert all(d["memory_free"] is None and d["temperature_c"] is None for d in after)  # no stale reading
    assert all(not d["available"] and d["error"] == "NVML did not start: Driver Not Loaded" for d in again)
    assert back == before
    lines = stderr.splitlines()
    assert len(lines) == 3 and lines[0].startswith("fake NVML: ") and "not valid JSON" in lines[0]
    assert lines[1:] == [f"the GPUs are unavailable: {why}",
                         "the GPUs are unavailable: NVML did not start: Driver Not Loaded"]


def test_one_nvml_session_serves_every_read_of_a_process(nvml_env):
    code = ("import pynvml\nfrom scheduler.devices import inventory\n"
            "for _ in range(5): inventory()\nprint(pynvml._nvmlLib_refcount)")  # nvmlInit's count
    out = run_python(code, nvml_env)
    assert out.stdout.strip() == "1", out.stderr  # opened once, kept open


@pytest.mark.parametrize("text, says", [
    ('{"devices": [', "not valid JSON at line 1"),
    (json.dumps({"devices": [fake_nvml.a100(7, 0), fake_nvml.a100(7, 0)]}), "a device named twice"),
    (json.dumps({"devices": [fake_nvml.a100(7, 0, processes=[{"pid": "abc"}])]}), "Linux pid"),
    (json.dumps({"devices": [fake_nvml.a100(7, 0, processes=[{"pid": -3}])]}), "Linux pid"),
    (json.dumps({"devices": [fake_nvml.a100(7, 0, temprature=3)]}), 'unknown key "temprature"'),
    (json.dumps({"devices": [fake_nvml.a100(7, 0, errors={"power": "ON_FIRE"})]}), "NVML error name"),
])
def test_a_bad_scenario_is_one_line_and_the_product_falls_back(nvml_env, scenario, text, says):
    fake_nvml.write(scenario, text)
    [devices], stderr = reads(nvml_env)
    assert all(d["virtual"] for d in devices)  # the process never saw a GPU: virtual devices
    lines = stderr.splitlines()
    assert len(lines) == 2, stderr
    assert lines[0].startswith(f"fake NVML: {scenario}: ") and says in lines[0]
    assert lines[1] == ("no NVIDIA GPU in use (NVML did not start: Unknown Error): 2 virtual CPU-backed GPUs "
                        "instead (SAE_DIST_VIRTUAL_GPUS=N chooses how many and skips NVML)")


def test_no_nvml_library_at_all_is_the_virtual_fallback_with_one_line(tmp_path):
    env = fake_nvml.environment(tmp_path / "empty", tmp_path / "none.json")  # nothing to load there
    [devices], stderr = reads(env)
    assert [d["uuid"] for d in devices] == ["virtual-0", "virtual-1"]
    assert stderr == ("no NVIDIA GPU in use (NVML did not start: NVML Shared Library Not Found): 2 virtual "
                      "CPU-backed GPUs instead (SAE_DIST_VIRTUAL_GPUS=N chooses how many and skips NVML)\n")


def test_the_benchmark_reads_the_link_and_other_processes(nvml_env, scenario):
    code = ("import json; from sae_dist.bench.run import _nvml_link; from sae_dist.bench.load import _GpuWatch\n"
            "w = _GpuWatch(); w.sample(set(), True); w.close()\n"
            "print(json.dumps([_nvml_link(), w.result()]))")
    s = fake_nvml.eight_a100s()
    s["devices"][0]["processes"] = [{"pid": 999999, "used_memory": 5 * fake_nvml.GIB, "sm_util": 40}]
    s["devices"][0]["utilization"] = 40
    fake_nvml.write(scenario, s)
    out = run_python(code, nvml_env)
    link, watch = json.loads(out.stdout)
    assert link == "NVLink"
    assert watch["gpus"] == 8 and watch["mean_utilization_pct"] == 5.0 and "error" not in watch
    assert watch["other_processes"] == [{"gpu": 0, "pid": 999999, "name": None, "attributable": False,
                                         "used_memory": 5 * fake_nvml.GIB, "sm_pct": 40.0}]
    for d in s["devices"]:
        del d["nvlink"]  # a PCIe-only machine: NVLink calls NOT_SUPPORTED
    fake_nvml.write(scenario, s)
    assert json.loads(run_python(code, nvml_env).stdout)[0] == "PCIe 4.0 x16"


def test_a_process_starting_while_a_gpu_is_lost_knows_it_from_an_earlier_one(nvml_env, scenario):
    [before], _ = reads(nvml_env)  # a process that saw every GPU (the daemon, an `info`)
    s = fake_nvml.eight_a100s()
    s["devices"][3]["errors"] = {"all": "GPU_IS_LOST"}
    fake_nvml.write(scenario, s)
    [after], _ = reads(nvml_env)  # a new process: `info`, `submit --gpu-ids 3`, the app
    assert [(d["index"], d["uuid"], d["pci_bus_id"]) for d in after] == \
        [(d["index"], d["uuid"], d["pci_bus_id"]) for d in before]  # nobody renumbered
    assert after[1]["lost"] and not after[1]["available"]


def known_file(env: dict) -> Path:
    return Path(env["SAE_DIST_HOME"]) / "nvml_devices.json"


@pytest.mark.slow
def test_a_fresh_process_while_nvml_is_broken_lists_the_gpus_this_host_saw(nvml_env, scenario):
    """nvmlInit failing in a process that never read the GPUs (`info`, the daemon, the app
    starting): the GPUs this host listed before, each unavailable with why, never virtual
    devices (GPU jobs must not land on the CPU)."""
    [before], _ = reads(nvml_env)  # an earlier process saw them: kept in the state home by host
    hosts = json.loads(known_file(nvml_env).read_text())["hosts"]
    assert list(hosts) == [socket.gethostname()] and len(hosts[socket.gethostname()]) == 8
    fake_nvml.write(scenario, dict(fake_nvml.eight_a100s(), init_error="DRIVER_NOT_LOADED"))
    [after], stderr = reads(nvml_env)
    assert [(d["index"], d["uuid"], d["pci_bus_id"], d["name"]) for d in after] == \
        [(d["index"], d["uuid"], d["pci_bus_id"], d["name"]) for d in before]
    why = "NVML did not start: Driver Not Loaded"
    assert all((d["available"], d["virtual"], d["error"], d["memory_free"]) == (False, False, why, None) for d in after)
    assert stderr == (f"the GPUs this host listed before are unavailable: {why} (they are kept in "
                      f"{known_file(nvml_env)}: delete it if this host has no GPU now, or set "
                      "SAE_DIST_VIRTUAL_GPUS=N for virtual CPU-backed GPUs)\n")


@pytest.mark.slow
def test_another_hosts_gpus_in_a_shared_state_home_are_never_this_hosts(nvml_env, scenario):
    """A state home shared between machines: the GPUs another host kept are not offered here,
    whether NVML fails to start (a host never seen: virtual devices, as without a file) or every
    GPU answers GPU_IS_LOST (unknown, not the other host's uuids); this host's entry is added
    beside the other's."""
    theirs = {str(i): {"uuid": f"GPU-other-{i}", "name": "NVIDIA H100 80GB HBM3",
                       "pci_bus_id": f"00000000:{i + 1:02X}:00.0"}
              for i in range(8)}
    known_file(nvml_env).parent.mkdir(parents=True, exist_ok=True)
    known_file(nvml_env).write_text(json.dumps({"hosts": {"another-host": theirs}}))
    s = fake_nvml.eight_a100s()
    lost = json.loads(json.dumps(s))
    for d in lost["devices"]:
        d["errors"] = {"all": "GPU_IS_LOST"}
    fake_nvml.write(scenario, dict(s, init_error="DRIVER_NOT_LOADED"))
    [broken], stderr = reads(nvml_env)
    assert [d["uuid"] for d in broken] == ["virtual-0", "virtual-1"] and "virtual CPU-backed GPUs instead" in stderr
    fake_nvml.write(scenario, lost)
    [all_lost], _ = reads(nvml_env)
    assert [d["uuid"] for d in all_lost] == [f"unknown-gpu-{i}" for i in range(8)] and all(d["lost"] for d in all_lost)
    fake_nvml.write(scenario, s)
    reads(nvml_env)  # a working read: this host's GPUs kept beside the other host's
    hosts = json.loads(known_file(nvml_env).read_text())["hosts"]
    assert hosts["another-host"] == theirs
    assert sorted(r["uuid"] for r in hosts[socket.gethostname()].values()) == sorted(d["uuid"] for d in s["devices"])


FREE_MEMORY = """
import json, os, sys
from sae_dist.train.free_memory import nvml_free_memory
asks = json.loads(sys.argv[1])
out = [nvml_free_memory(uuid, bus) for uuid, bus in asks]
os.replace(sys.argv[2], os.environ["FAKE_NVML_SCENARIO"])  # the driver stops loading
out.append(nvml_free_memory(*asks[0]))
print(json.dumps(out))
"""


def test_balance_memory_reads_each_ranks_free_memory_from_nvml_by_uuid_or_bus_id(nvml_env, scenario):
    """What a rank of `--balance memory` asks NVML for its GPU (named by the UUID, else the PCI
    bus id, CUDA reports for it: CUDA itself is what no emulation reaches), with unequal free
    memory; and why NVML could not say, for the log, where the rank falls back to CUDA."""
    s = fake_nvml.eight_a100s()
    by_bus = fake_nvml.in_bus_order(s)  # index order
    for d, used in zip(by_bus, [10, 40, 0, 70, 0, 0, 0, 0]):
        d["memory_used"] = used * fake_nvml.GIB
    by_bus[4]["errors"] = {"all": "GPU_IS_LOST"}
    fake_nvml.write(scenario, s)
    broken = fake_nvml.write(scenario.with_name("broken.json"), dict(s, init_error="DRIVER_NOT_LOADED"))
    asks = [[by_bus[0]["uuid"], None], [by_bus[1]["uuid"], None], [None, "0000:0f:00.0"],  # bus 0F: index 1
            [None, by_bus[3]["pci_bus_id"]], ["GPU-00000000-0000-0000-0000-000000000000", None],
            [by_bus[4]["uuid"], None]]
    out = run_python(FREE_MEMORY, nvml_env, json.dumps(asks), str(broken))
    assert out.returncode == 0, out.stderr
    got = [tuple(r) for r in json.loads(out.stdout)]
    gib = fake_nvml.GIB
    assert got == [(70 * gib, None), (40 * gib, None), (40 * gib, None), (10 * gib, None),
                   (None, "NVML could not read GPU-00000000-0000-0000-0000-000000000000: Not Found"),
                   (None, f"NVML could not read {by_bus[4]['uuid']}: GPU is lost"),
                   (None, "NVML did not start: Driver Not Loaded")]
    # Three ranks on GPUs 0, 1 and 3: their shares follow NVML's free memory, and the log says so.
    ranks = [choose(n, why, None) for n, why in got[:2] + got[3:4]]
    weights, why = initial_weights("memory", [free for free, _ in ranks], [None] * 3)
    assert weights == [70.0 * gib, 40.0 * gib, 10.0 * gib]
    assert f"{why}; {sources_line([src for _, src in ranks])}" == \
        "in proportion to free memory (70.0, 40.0, 10.0 GiB); free memory from NVML"


# ---- the decisions, on plain data ----

def gpu(i: int, uuid: str, bus: str | None) -> DeviceInfo:
    return DeviceInfo(index=i, uuid=uuid, name="A100", pci_bus_id=bus)


def test_gpus_are_numbered_by_bus_id_and_an_unknown_one_goes_last():
    read = [gpu(0, "c", "00000000:B7:00.0"), gpu(1, "unknown-gpu-1", None), gpu(2, "a", "00000000:07:00.0"),
            gpu(3, "b", "00000000:0f:00.0")]
    assert [(d.index, d.uuid) for d in in_bus_order(read)] == [(0, "a"), (1, "b"), (2, "c"), (3, "unknown-gpu-1")]


def test_identity_is_kept_by_nvml_index_and_only_from_a_matching_machine():
    known = {0: gpu(0, "a", "00000000:07:00.0"), 1: gpu(1, "b", "00000000:0F:00.0")}
    read = [gpu(0, "a", "00000000:07:00.0"), gpu(1, "unknown-gpu-1", None)]
    kept = keep_identity(read, known)
    assert (kept[1].uuid, kept[1].pci_bus_id) == ("b", "00000000:0F:00.0")
    assert trusted_identities(read, known) == known
    assert trusted_identities([gpu(0, "z", None), read[1]], known) == {}  # another machine, or re-enumerated
    assert trusted_identities(read[:1], known) == {}  # a GPU fewer: not the same enumeration


def test_a_lost_gpu_is_recorded_once_and_never_without_a_uuid():
    lost = replace(gpu(0, "a", None), available=False, error="handle: GPU is lost", lost=True)
    unknown = replace(gpu(1, "unknown-gpu-1", None), available=False, error="handle: GPU is lost", lost=True)
    flaky = replace(gpu(2, "c", None), available=False, error="power: Unknown Error")
    assert lost_to_record([lost, unknown, flaky], {}, {"a": 7}) == [("a", "NVML: handle: GPU is lost", 7)]
    open_fault = Fault(device_uuid="a", reason="x", since=datetime.now(timezone.utc), latest=datetime.now(timezone.utc))
    assert lost_to_record([lost], {"a": open_fault}, {}) == []


def test_the_probe_verdict_keeps_what_was_checked():
    note = "checked: NVML only (torch 2.13.0+cpu has no CUDA here)"
    assert verdict("GPU-a", f"{note}\nHEALTHY\n").detail == f"health check passed ({note})"
    assert verdict("virtual-0", "HEALTHY\n").detail == "health check passed"
    failed = verdict("GPU-a", "GPU-a failed its health check: NVMLError_GpuIsLost: GPU is lost\n")
    assert not failed.healthy and failed.detail.endswith("GPU is lost")


@CPU_TORCH
def test_the_probe_checks_nvml_alone_without_cuda_and_fails_a_lost_gpu(nvml_env, scenario):
    uuid = fake_nvml.eight_a100s()["devices"][2]["uuid"]
    ok = subprocess.run([sys.executable, "-m", "scheduler.probe", uuid], cwd=REPO, env=nvml_env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "HEALTHY", ok.stderr
    assert ok.stdout.splitlines()[0].startswith("checked: NVML only (torch ")
    s = fake_nvml.eight_a100s()
    s["devices"][2]["errors"] = {"all": "GPU_IS_LOST"}
    fake_nvml.write(scenario, s)
    bad = subprocess.run([sys.executable, "-m", "scheduler.probe", uuid], cwd=REPO, env=nvml_env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stdout == f"{uuid} failed its health check: NVMLError_GpuIsLost: GPU is lost\n"


def test_a_jobs_process_on_a_gpu_no_job_holds_makes_it_busy():
    stray = DeviceInfo(index=4, uuid="GPU-4", name="A100", processes=[(321, 2 * fake_nvml.GIB)],
                       memory_used=2 * fake_nvml.GIB)
    held = DeviceInfo(index=0, uuid="GPU-0", name="A100", processes=[(321, fake_nvml.GIB)])
    states = classify([held, stray], {"GPU-0": 7}, {7: 0.0}, {321}, now=1000.0)
    assert states["GPU-0"].state == "allocated"
    assert (states["GPU-4"].state, states["GPU-4"].reason) == (
        "busy", "used by pid 321 of a scheduler job, outside the devices it was given")


def test_the_kept_gpus_are_per_host_and_a_file_of_another_format_is_none():
    a = {0: ("GPU-a", "A100", "00000000:07:00.0"), 1: ("GPU-b", "A100", None)}
    text = known_gpus.merged(None, "node1", a)
    assert known_gpus.parse(text, "node1") == a and known_gpus.parse(text, "node2") == {}
    both = known_gpus.merged(text, "node2", {0: ("GPU-z", "H100", None)})
    assert known_gpus.parse(both, "node1") == a and known_gpus.parse(both, "node2") == {0: ("GPU-z", "H100", None)}
    assert known_gpus.parse(known_gpus.merged(both, "node1", {}), "node2") == {0: ("GPU-z", "H100", None)}
    before_hosts = json.dumps({"0": {"uuid": "GPU-a", "name": "A100", "pci_bus_id": None}})  # the old, host-less file
    for damaged in (before_hosts, "{", "[]", '{"hosts": {"node1": {"x": {}}}}'):
        assert known_gpus.parse(damaged, "node1") == {}
        assert known_gpus.parse(known_gpus.merged(damaged, "node1", a), "node1") == a


def test_free_memory_comes_from_nvml_else_cuda_and_the_log_says_which():
    assert choose(5, None, 7) == (5, "from NVML")
    assert choose(None, "NVML did not start: Driver Not Loaded", 7) == (7, "from CUDA "
                                                                           "(NVML did not start: Driver Not Loaded)")
    assert choose(None, None, None) == (None, "unknown")
    assert sources_line(["from NVML"] * 3) == "free memory from NVML"
    assert sources_line(["from NVML", "from CUDA (NVML could not read GPU-b: GPU is lost)", "from NVML"]) == \
        "free memory from NVML (ranks 0, 2), from CUDA (NVML could not read GPU-b: GPU is lost) (rank 1)"

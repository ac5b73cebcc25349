"""Device inventory (NVML and virtual), busy detection and memory-based recommendation.

Virtual devices are measured on a real child process; NVML is exercised for real where no driver
exists (it must return None, not raise) and through a small stand-in for the pynvml module to
reach per-device errors and unsupported fields, which need a GPU to happen for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from conftest import REPO
from sae_dist.errors import UserError
from scheduler.busy import DeviceState, classify
from scheduler.devices import (
    CpuSampler,
    DeviceInfo,
    inventory,
    machine_memory,
    nvml_inventory,
    read_device,
    virtual_count,
    virtual_inventory,
)
from scheduler.recommend import parse_memory, recommend

GIB = 2**30
MIB = 2**20
HAS_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version").exists()


def test_modules_import_without_heavy_dependencies():
    code = ("import sys, scheduler.devices, scheduler.busy, scheduler.recommend\n"
            "print(sorted({'torch', 'streamlit', 'altair', 'pynvml'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- NVML -------------------------------------------------------------------------------------


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # the real bindings map the code to its subclass


class FakeNvml:
    """Stands in for the pynvml module: its names and exception classes, readings from `gpus`.

    Each gpu is a dict of field -> value; an exception instance as a value is raised instead.
    """

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, gpus: list[dict], init_error: Exception | None = None):
        self.gpus, self.init_error, self.calls = gpus, init_error, []

    def _get(self, handle: int, key: str):
        value = self.gpus[handle][key]
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if "handle" in self.gpus[i]:
            self._get(i, "handle")  # raises the error the test set
        return i

    def nvmlDeviceGetUUID(self, h):
        return self._get(h, "uuid")

    def nvmlDeviceGetName(self, h):
        return self._get(h, "name")

    def nvmlDeviceGetMemoryInfo(self, h):
        total, used = self._get(h, "memory")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._get(h, "util"), memory=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._get(h, "temp")

    def nvmlDeviceGetPowerUsage(self, h):
        return self._get(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._get(h, "limit_mw")

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self._get(h, "procs")]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._get(h, "bus"))  # raw bytes, as the real struct gives


def healthy_gpu(i: int, **changes) -> dict:
    gpu = dict(uuid=f"GPU-{i}", name="NVIDIA H100", memory=(80 * GIB, 2 * GIB), util=37, temp=51,
               power_mw=123_456, limit_mw=700_000, procs=[(4242, GIB), (4343, None)],
               bus=f"00000000:{i + 1:02X}:00.0".encode())
    return {**gpu, **changes}


def test_nvml_without_driver_returns_none():
    if HAS_NVIDIA_DRIVER:
        pytest.skip("this machine has an NVIDIA driver")
    assert nvml_inventory() is None


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
                                  pynvml.NVML_ERROR_NO_PERMISSION])
def test_nvml_that_cannot_start_returns_none(code):
    assert nvml_inventory(FakeNvml([healthy_gpu(0)], init_error=nvml_error(code))) is None


def test_nvml_with_no_gpu_returns_none_and_shuts_down():
    fake = FakeNvml([])
    assert nvml_inventory(fake) is None
    assert fake.calls == ["init", "shutdown"]


def test_nvml_reads_every_field(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    fake = FakeNvml([healthy_gpu(0), healthy_gpu(1)])
    devices = nvml_inventory(fake)
    assert fake.calls == ["init", "shutdown"]
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    d = devices[1]
    assert (d.index, d.uuid, d.name, d.virtual, d.available, d.error) == (1, "GPU-1", "NVIDIA H100", False, True, None)
    assert (d.memory_total, d.memory_used, d.memory_free) == (80 * GIB, 2 * GIB, 78 * GIB)
    assert (d.utilization_pct, d.temperature_c, d.power_w, d.power_limit_w) == (37.0, 51.0, 123.456, 700.0)
    assert d.processes == [(4242, GIB), (4343, None)]
    assert d.pci_bus_id == "00000000:02:00.0"


def test_unsupported_fields_are_none_not_errors():
    unsupported = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    d = read_device(FakeNvml([healthy_gpu(0, temp=unsupported, power_mw=unsupported, limit_mw=unsupported,
                                           util=unsupported)]), 0)
    assert d.available and d.error is None
    assert (d.temperature_c, d.power_w, d.power_limit_w, d.utilization_pct) == (None, None, None, None)
    assert d.memory_total == 80 * GIB


def test_calls_missing_from_an_old_driver_are_none_not_errors():
    missing = nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    fake = FakeNvml([healthy_gpu(0, power_mw=missing)])

    def newer_temperature_call(handle, sensor):
        raise missing  # a driver older than nvmlDeviceGetTemperatureV

    fake.nvmlDeviceGetTemperatureV = newer_temperature_call
    d = read_device(fake, 0)
    assert d.available and d.error is None
    assert (d.power_w, d.temperature_c) == (None, 51.0)  # temperature read through the older call


def test_one_unreadable_gpu_is_unavailable_and_the_others_are_read():
    lost = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    devices = nvml_inventory(FakeNvml([healthy_gpu(0, memory=lost, procs=lost), healthy_gpu(1)]))
    bad, good = devices
    assert not bad.available and "memory: GPU is lost" in bad.error and "processes: GPU is lost" in bad.error
    assert (bad.uuid, bad.name, bad.temperature_c, bad.memory_total) == ("GPU-0", "NVIDIA H100", 51.0, None)
    assert good.available and good.memory_free == 78 * GIB


def test_gpu_without_a_handle_is_unavailable():
    d = read_device(FakeNvml([healthy_gpu(0, handle=nvml_error(pynvml.NVML_ERROR_UNKNOWN))]), 0)
    assert (d.available, d.uuid, d.error) == (False, "unknown-gpu-0", "handle: Unknown Error")


# --- virtual devices --------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    blob = b"x" * (200 * 2**20)  # written, so resident
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.process_time() + 1.0  # one CPU second, however busy the machine is
    while time.process_time() < end:
        pass
    print("done", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_virtual_devices_measure_their_processes(child):
    sampler = CpuSampler()
    pids = {"virtual-0": [child.pid]}
    first = virtual_inventory(2, pids, sampler)
    d0, d1 = first
    assert (d0.uuid, d0.name, d0.virtual, d0.available) == ("virtual-0", "Virtual GPU 0 (CPU-backed)", True, True)
    assert d0.memory_used >= 200 * MIB and d0.processes == [(child.pid, d0.memory_used)]
    assert d0.memory_total == machine_memory() // 2 and d0.memory_free == d0.memory_total - d0.memory_used
    assert (d0.temperature_c, d0.power_w, d0.power_limit_w, d0.pci_bus_id) == (None, None, None, None)
    assert (d1.memory_used, d1.utilization_pct, d1.processes) == (0, 0.0, [])

    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "done"
    burning = virtual_inventory(2, pids, sampler)[0].utilization_pct
    assert 0 < burning <= 100

    time.sleep(0.3)  # the child now waits on stdin: no CPU between these two calls
    idle = virtual_inventory(2, pids, sampler)[0].utilization_pct
    assert idle < burning and idle <= 10


def test_virtual_devices_skip_vanished_processes(child):
    child.kill()
    child.wait()
    d0 = virtual_inventory(1, {"virtual-0": [child.pid]}, CpuSampler())[0]
    assert (d0.memory_used, d0.processes, d0.utilization_pct) == (0, [], 0.0)


def test_virtual_count(monkeypatch):
    monkeypatch.delenv("SAE_DIST_VIRTUAL_GPUS", raising=False)
    assert virtual_count() == 2
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", " 4 ")
    assert virtual_count() == 4


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5", "1000"])
def test_bad_virtual_count_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", value)
    with pytest.raises(UserError, match="SAE_DIST_VIRTUAL_GPUS"):
        virtual_count()


def test_inventory_falls_back_to_virtual_devices(monkeypatch):
    assert [d.uuid for d in inventory(virtual=3)] == ["virtual-0", "virtual-1", "virtual-2"]
    if HAS_NVIDIA_DRIVER:
        pytest.skip("this machine has an NVIDIA driver: inventory() reads it")
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "3")
    devices = inventory()
    assert len(devices) == 3 and all(d.virtual for d in devices)


# --- busy detection ---------------------------------------------------------------------------


def gpu(i: int, free_gib: float = 70.0, used_mib: int = 0, procs=(), available=True, virtual=False) -> DeviceInfo:
    total = 80 * GIB
    return DeviceInfo(index=i, uuid=f"GPU-{i}", name="H100", virtual=virtual, available=available,
                      error=None if available else "GPU is lost", memory_total=total,
                      memory_used=used_mib * MIB, memory_free=int(free_gib * GIB), processes=list(procs))


def classify_at(devices, allocations=None, started=None, ours=frozenset(), now=1000.0):
    return classify(devices, allocations or {}, started or {}, set(ours), now)


def test_classify_basic_states():
    states = classify_at([gpu(0), gpu(1, available=False), gpu(2), gpu(3, procs=[(999, GIB)])],
                         allocations={"GPU-2": 7}, started={7: 0.0})
    assert states["GPU-0"] == DeviceState("idle", None, "free")
    assert states["GPU-1"] == DeviceState("unavailable", None, "GPU is lost")
    assert states["GPU-2"] == DeviceState("allocated", 7, "job 7")
    assert states["GPU-3"] == DeviceState("busy", None, "used by pid 999, not a scheduler job")


def test_classify_memory_threshold():
    states = classify_at([gpu(0, used_mib=400), gpu(1, used_mib=2048), gpu(2, used_mib=2048, procs=[(5, 2 * GIB)])],
                         ours={5})
    assert states["GPU-0"].state == "idle"  # driver noise below 512 MiB
    assert states["GPU-1"] == DeviceState("busy", None, "2048 MiB in use by something else")
    # A job's process on a GPU no job holds went around its allocation: busy, whatever its memory.
    assert states["GPU-2"] == DeviceState("busy", None,
                                          "used by pid 5 of a scheduler job, outside the devices it was given")


def test_virtual_devices_are_never_busy_from_memory():
    assert classify_at([gpu(0, used_mib=50_000, virtual=True)])["GPU-0"].state == "idle"


def test_classify_grace_window_for_a_starting_job():
    device = gpu(0, used_mib=3000, procs=[(111, GIB), (222, GIB)])
    starting = classify_at([device], {"GPU-0": 3}, {3: 990.0}, ours={111}, now=1000.0)["GPU-0"]
    assert starting == DeviceState("allocated", 3, "job 3")  # 222 is a rank we have not recorded yet
    later = classify_at([device], {"GPU-0": 3}, {3: 900.0}, ours={111}, now=1000.0)["GPU-0"]
    assert later == DeviceState("allocated", 3, "job 3; also used by pid 222, not a scheduler job")


# --- recommendation ---------------------------------------------------------------------------


def test_recommend_picks_most_free_memory_and_explains_the_rest():
    devices = [gpu(0, free_gib=30), gpu(1, free_gib=70), gpu(2, free_gib=3.1), gpu(3, available=False),
               gpu(4, procs=[(1234, GIB)]), gpu(5, free_gib=70), gpu(6, free_gib=30)]
    states = classify_at(devices, allocations={"GPU-5": 3}, started={3: 0.0})
    rec = recommend(devices, states, 2, parse_memory("20GiB"))
    assert rec.error is None
    assert rec.chosen == ["GPU-1", "GPU-0"]  # 70 GiB first, then 30 GiB: index 0 before index 6
    assert rec.passed_over == {
        "GPU-2": "low memory: 3.1 GiB free, 20.0 GiB needed",
        "GPU-3": "unavailable: GPU is lost",
        "GPU-4": "busy: used by pid 1234, not a scheduler job",
        "GPU-5": "allocated to job 3",
        "GPU-6": "not needed: 2 devices with at least as much free memory chosen",
    }


def test_recommend_without_a_memory_need():
    devices = [gpu(0, free_gib=1), gpu(1, free_gib=2)]
    assert recommend(devices, classify_at(devices), 1, None).chosen == ["GPU-1"]


def test_recommend_says_how_many_fit_and_why_not():
    devices = [gpu(0, free_gib=30), gpu(1, free_gib=3.1), gpu(2)]
    rec = recommend(devices, classify_at(devices, allocations={"GPU-2": 3}), 2, 20 * GIB)
    assert rec.chosen == []
    assert rec.error == ("2 devices requested with 20.0 GiB free each, but only 1 fit "
                         "(GPU 1: low memory: 3.1 GiB free, 20.0 GiB needed; GPU 2: allocated to job 3)")
    rec = recommend(devices, classify_at(devices), 5, None)
    assert rec.error.startswith("5 devices requested but this machine has 3")
    with pytest.raises(UserError, match="at least 1"):
        recommend(devices, classify_at(devices), 0, None)


@pytest.mark.parametrize("text, expected", [
    ("20GiB", 20 * GIB), ("20gib", 20 * GIB), ("20G", 20 * GIB), ("20GB", 20 * GIB), ("512M", 512 * MIB),
    ("1.5G", int(1.5 * GIB)), ("1024", 1024 * MIB), (" 2 T ", 2 * 2**40), ("64k", 64 * 1024),
    ("100B", 100), (".5G", GIB // 2),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "abc", "G", "-1G", "0", "0G", "1.5.5G", "10X", "1e3", "nan", "inf",
                                  "20 GiB GiB", "5iB", "1,5G", "0.0000001"])
def test_parse_memory_rejects_with_the_bad_string(text):
    with pytest.raises(UserError) as err:
        parse_memory(text)
    assert repr(text) in str(err.value)

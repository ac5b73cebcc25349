"""What devices this machine has, and what each is doing right now.

The scheduler, `info` and the app all need one inventory: every NVIDIA GPU as NVML sees it
(identified by UUID, numbered in PCI bus order for people), or, on a machine without one,
CPU-backed "virtual GPUs" (one gloo rank each) whose figures are measured from /proc. A GPU NVML
cannot read is reported as unavailable instead of crashing the daemon, and a figure nobody
measured (a virtual device's temperature or power, a sensor a card lacks) stays None.

pynvml is imported inside functions so that `python -m scheduler queue` starts fast.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable

from sae_dist.errors import UserError
from scheduler import procs

if TYPE_CHECKING:
    from scheduler.faults import Fault


def _log():
    """This module's logger; logging is imported on first use (it costs `submit` ~5 ms)."""
    import logging

    return logging.getLogger(__name__)


VIRTUAL_ENV_VAR = "SAE_DIST_VIRTUAL_GPUS"
DEFAULT_VIRTUAL_GPUS = 2
# Each virtual device is one CPU rank: more than this is a typo, not a machine.
MAX_VIRTUAL_GPUS = 64
# NVML numbers GPUs in PCI bus order; CUDA only agrees when told to.
CUDA_DEVICE_ORDER = "PCI_BUS_ID"


@dataclass
class DeviceInfo:
    """One device's identity and its readings at one moment; None means "not measured"."""

    index: int  # for people (nvidia-smi's number); never used as an identity
    uuid: str  # the identity: "GPU-..." from NVML, "virtual-<i>" for CPU-backed devices
    name: str
    virtual: bool = False
    available: bool = True
    error: str | None = None  # why the device, or some of its fields, could not be read
    memory_total: int | None = None  # bytes
    memory_used: int | None = None
    memory_free: int | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes or None)
    pci_bus_id: str | None = None
    fault: Fault | None = None  # a training rank died on it and no health check has passed since
    lost: bool = False  # NVML says the GPU fell off the bus or needs a reset: a fault, not a blip

    @property
    def label(self) -> str:
        """How people refer to the device in messages: "GPU 0" or "virtual GPU 0"."""
        return f"{'virtual ' if self.virtual else ''}GPU {self.index}"


# ---------------------------------------------------------------------------------------------
# NVML


# The NVML errors that mean the GPU itself is gone until a reset: the daemon records a fault
# (see scheduler.health), where any other error leaves the device unavailable for that read only.
LOST_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")
UNKNOWN_PREFIX = "unknown-gpu-"  # the uuid of a GPU whose handle NVML refused, never seen before


def _text(value: Any) -> str:
    # pynvml returns str for most strings but raw bytes for char arrays inside structs (busId).
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _compute_processes(nvml: Any, handle: Any) -> list[tuple[int, int | None]]:
    try:
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except getattr(nvml, "NVMLLibraryMismatchError", ()):
        # A driver older than the bindings lacks the _v3 call the unversioned name maps to.
        procs = nvml.nvmlDeviceGetComputeRunningProcesses_v2(handle)
    # usedGpuMemory is None where the driver cannot tell (pynvml maps NVML's "not available").
    return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]


def _temperature(nvml: Any, handle: Any) -> float:
    # nvmlDeviceGetTemperature is deprecated (to be removed with CUDA 14); drivers before the
    # versioned call (nvmlDeviceGetTemperatureV) only have the old one.
    newer = getattr(nvml, "nvmlDeviceGetTemperatureV", None)
    if newer is not None:
        try:
            return newer(handle, nvml.NVML_TEMPERATURE_GPU)
        except nvml.NVMLError_FunctionNotFound:
            pass
    return nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)


def _memory_info(nvml: Any, handle: Any) -> Any:
    # The versioned call counts as used only what was allocated; the old one adds the memory
    # the driver reserves for itself (618 MiB on an idle H200 with driver 580), which read as a
    # user and kept every job off an idle GPU. Drivers before it only have the old call.
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except (nvml.NVMLError_FunctionNotFound, getattr(nvml, "NVMLError_ArgumentVersionMismatch", ())):
            pass
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def read_device(nvml: Any, index: int) -> DeviceInfo:
    """Read one GPU through `nvml` (the pynvml module, or a stand-in with its names). Never raises.

    A field the card (NotSupported) or the driver (FunctionNotFound) does not offer stays None;
    any other error marks the device unavailable and is kept in `error`, alongside whatever
    fields could still be read.
    """
    info = DeviceInfo(index=index, uuid=f"{UNKNOWN_PREFIX}{index}", name=f"GPU {index}")
    errors: list[str] = []

    lost_errors = tuple(getattr(nvml, name) for name in LOST_ERRORS if hasattr(nvml, name))

    def read(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
            return None
        except Exception as exc:  # NVMLError, or a bindings/driver mismatch: same verdict
            errors.append(f"{what}: {exc}")
            info.lost = info.lost or isinstance(exc, lost_errors)
            return None

    handle = read("handle", nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        info.available, info.error = False, "; ".join(errors) or "no handle"
        return info
    uuid = read("uuid", nvml.nvmlDeviceGetUUID, handle)
    if uuid is not None:
        info.uuid = _text(uuid)
    name = read("name", nvml.nvmlDeviceGetName, handle)
    if name is not None:
        info.name = _text(name)
    mem = read("memory", _memory_info, nvml, handle)
    if mem is not None:
        info.memory_total, info.memory_used, info.memory_free = int(mem.total), int(mem.used), int(mem.free)
    util = read("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
    if util is not None:
        info.utilization_pct = float(util.gpu)
    temp = read("temperature", _temperature, nvml, handle)
    if temp is not None:
        info.temperature_c = float(temp)
    power = read("power", nvml.nvmlDeviceGetPowerUsage, handle)
    if power is not None:
        info.power_w = power / 1000.0  # NVML reports milliwatts
    limit = read("power limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    if limit is not None:
        info.power_limit_w = limit / 1000.0
    procs = read("processes", _compute_processes, nvml, handle)
    if procs is not None:
        info.processes = procs
    pci = read("pci", nvml.nvmlDeviceGetPciInfo, handle)
    if pci is not None:
        info.pci_bus_id = _text(pci.busId)
    if errors:
        info.available, info.error = False, "; ".join(errors)
    return info


def in_bus_order(devices: list[DeviceInfo]) -> list[DeviceInfo]:
    """The GPUs sorted by PCI bus id and numbered so, which is CUDA's order under
    CUDA_DEVICE_ORDER=PCI_BUS_ID. NVML's own enumeration order is not promised to be the bus
    order (its documentation says to identify GPUs by UUID or bus id); a GPU whose bus id could
    not be read goes last, in NVML's order."""
    ordered = sorted(enumerate(devices), key=lambda p: (p[1].pci_bus_id is None, (p[1].pci_bus_id or "").upper(), p[0]))
    return [replace(d, index=i) for i, (_, d) in enumerate(ordered)]


def keep_identity(devices: list[DeviceInfo], known: dict[int, DeviceInfo]) -> list[DeviceInfo]:
    """A GPU whose handle NVML refused (a lost GPU fails already there) keeps the uuid, name and
    bus id it had at the same NVML index in an earlier read (`known`): it is the same device, now
    failing, not a new one, and the job holding it, its fault and its samples follow its uuid."""
    out = []
    for nvml_index, d in enumerate(devices):
        before = known.get(nvml_index)
        if d.uuid.startswith(UNKNOWN_PREFIX) and before is not None:
            d = replace(d, uuid=before.uuid, name=before.name, pci_bus_id=before.pci_bus_id)
        out.append(d)
    return out


def all_unavailable(known: list[DeviceInfo], why: str) -> list[DeviceInfo]:
    """The GPUs NVML listed before, each unavailable for `why`, with no reading: what a process
    that has seen GPUs reports when NVML stops answering, rather than switching to virtual
    devices (which would start GPU jobs on the CPU, and drop the GPUs' jobs and faults)."""
    return [DeviceInfo(index=d.index, uuid=d.uuid, name=d.name, available=False, error=why,
                       pci_bus_id=d.pci_bus_id) for d in known]


class _NvmlMemory:
    """What NVML said in this process: the GPUs of the last read (by NVML index, for
    `keep_identity`; in bus order, for `all_unavailable`), and the last reason told for using
    virtual devices (said once, not once a second)."""

    def __init__(self, persist: bool = False) -> None:
        self.persist = persist  # kept in the state home for the next process (pynvml's, not a stand-in's)
        self.saved: dict[int, DeviceInfo] = {}
        self.by_nvml_index: dict[int, DeviceInfo] = {}
        self.open = False  # an NVML session of this process is open (nvmlInit without its shutdown)
        self.listed: list[DeviceInfo] = []
        self.fallback_told: str | None = None
        self.last_reason: str | None = None  # why the last read found no GPU
        self.recalled = False  # the GPUs an earlier process of this host listed were looked for


_memory = _NvmlMemory(persist=True)


def trusted_identities(read: list[DeviceInfo], cached: dict[int, DeviceInfo]) -> dict[int, DeviceInfo]:
    """`cached` (identities by NVML index, from an earlier process), if every GPU readable now
    sits at the index it had then (the same machine, enumerated the same way); else nothing."""
    same = all(d.uuid == cached[i].uuid for i, d in enumerate(read)
               if not d.uuid.startswith(UNKNOWN_PREFIX) and i in cached)
    return cached if same and len(cached) == len(read) else {}


def _load_identities() -> dict[int, DeviceInfo]:
    """What an earlier process saw on this host at each NVML index (scheduler.known_gpus), for a
    process that starts while a GPU is lost (`info`, `submit --gpu-ids`, the app): without it
    the lost GPU would have no uuid, no bus id, and shift the numbering of every GPU after it."""
    from scheduler import known_gpus

    return {i: DeviceInfo(index=i, uuid=uuid, name=name, pci_bus_id=bus)
            for i, (uuid, name, bus) in known_gpus.load().items()}


def _save_identities(by_index: dict[int, DeviceInfo]) -> None:
    from scheduler import known_gpus

    try:
        known_gpus.save({i: (d.uuid, d.name, d.pci_bus_id) for i, d in by_index.items()})
    except OSError as exc:  # a read-only state home: the next process starting may not know a lost GPU
        _log().debug("could not keep the GPUs' identities: %s", exc)


def _read_all(nvml: Any, memory: _NvmlMemory) -> list[DeviceInfo]:
    count = nvml.nvmlDeviceGetCount()
    read = [read_device(nvml, i) for i in range(count)]
    if memory.persist and not memory.by_nvml_index:  # a process's first read: what others saw
        memory.by_nvml_index = trusted_identities(read, _load_identities())
        memory.saved = dict(memory.by_nvml_index)
    read = keep_identity(read, memory.by_nvml_index)
    memory.by_nvml_index.update((i, d) for i, d in enumerate(read) if not d.uuid.startswith(UNKNOWN_PREFIX))
    known = {i: (d.uuid, d.name, d.pci_bus_id) for i, d in memory.by_nvml_index.items()}
    if memory.persist and known != {i: (d.uuid, d.name, d.pci_bus_id) for i, d in memory.saved.items()}:
        _save_identities(memory.by_nvml_index)
        memory.saved = dict(memory.by_nvml_index)
    return in_bus_order(read)


def nvml_inventory(nvml: ModuleType | Any | None = None, memory: _NvmlMemory | None = None) -> list[DeviceInfo] | None:
    """Every GPU NVML sees, in PCI bus order; None when NVML cannot start or finds none (the
    reason is kept for the one line `inventory` says), unless this process, or an earlier one
    on this host (scheduler.known_gpus), has seen GPUs: then they are listed, unavailable,
    with the reason, so that no GPU job is started on the CPU in their place.

    Sets CUDA_DEVICE_ORDER=PCI_BUS_ID in this process (and so in what it spawns) so that CUDA's
    numbering agrees with the indices reported here. `nvml` defaults to pynvml, with this
    process's memory; tests pass a stand-in (with a memory of its own, or a fresh one). Never raises.
    """
    memory = memory or (_memory if nvml is None else _NvmlMemory())
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return _no_nvml("nvidia-ml-py is not installed", memory)
    if not memory.open:
        try:
            nvml.nvmlInit()
        except Exception as exc:  # no driver library, driver not loaded, no permission...
            return _no_nvml(f"NVML did not start: {exc}", memory)
    os.environ["CUDA_DEVICE_ORDER"] = CUDA_DEVICE_ORDER
    # The process's own NVML session stays open while it reads GPUs (as NVIDIA's device plugin
    # keeps its): without persistence mode each nvmlInit sets the GPUs up again, which at the
    # daemon's one read a second would be most of its work. A stand-in's closes after each read.
    memory.open, keep = True, False
    try:
        gpus = _read_all(nvml, memory)
        if not gpus:
            return _no_nvml("NVML found no GPU", memory)
        memory.listed, memory.fallback_told, memory.last_reason = gpus, None, None
        keep = memory.persist
        return gpus
    except Exception as exc:
        return _no_nvml(f"NVML started but could not count GPUs: {exc}", memory)
    finally:
        if not keep:
            memory.open = False
            try:
                nvml.nvmlShutdown()
            except Exception as exc:
                _log().debug("nvmlShutdown failed: %s", exc)


def _no_nvml(why: str, memory: _NvmlMemory) -> list[DeviceInfo] | None:
    if not memory.listed and memory.persist and not memory.recalled:  # a fresh process: the GPUs
        memory.recalled = True  # this host listed before (read once: not at each of the daemon's passes)
        remembered = _load_identities()
        memory.listed = in_bus_order([remembered[i] for i in sorted(remembered)])
        if memory.listed:
            from scheduler.known_gpus import path

            _log().warning("the GPUs this host listed before are unavailable: %s (they are kept in %s: "
                           "delete it if this host has no GPU now, or set %s=N for virtual CPU-backed "
                           "GPUs)", why, path(), VIRTUAL_ENV_VAR)
            memory.fallback_told = why
    if memory.listed:
        if memory.fallback_told != why:
            _log().warning("the GPUs are unavailable: %s", why)
            memory.fallback_told = why
        return all_unavailable(memory.listed, why)
    memory.last_reason = why
    return None


def _tell_fallback(count: int) -> None:
    """One line, once per reason and process, on why the devices are virtual."""
    why = _memory.last_reason or "NVML found no GPU"
    if _memory.fallback_told != why:
        _log().warning("no NVIDIA GPU in use (%s): %d virtual CPU-backed GPUs instead "
                       "(%s=N chooses how many and skips NVML)", why, count, VIRTUAL_ENV_VAR)
        _memory.fallback_told = why


# ---------------------------------------------------------------------------------------------
# Virtual devices: readings from /proc


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _now_since_boot() -> float:
    # The clock /proc/<pid>/stat's start time is measured on, so lifetimes can be computed.
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def read_rss(pid: int) -> int | None:
    """Resident memory of a process in bytes (VmRSS), or None when it is gone or has none."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError):
        pass
    return None


def read_cpu_times(pid: int) -> tuple[float, float] | None:
    """(CPU seconds used, start time in seconds since boot) of a process, or None when gone."""
    reading = procs.cpu_ticks(pid)
    if reading is None:
        return None
    ticks, start = reading
    hz = _clock_ticks()
    return ticks / hz, start / hz


def machine_memory() -> int:
    """The machine's MemTotal in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity), which is what the ranks share."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CpuSampler:
    """Measures the CPU used by processes between two calls, from /proc/<pid>/stat.

    It keeps each pid's previous reading. A pid seen for the first time is measured over its
    whole life so far (from its start time), so even the first call reports a measured figure.
    """

    def __init__(self) -> None:
        self._previous: dict[int, tuple[float, float, float]] = {}  # pid -> (cpu_s, start, at)

    def cores_used(self, pids: Iterable[int]) -> float:
        """How many cores the processes used together since the last call (0 for none)."""
        now = _now_since_boot()
        total = 0.0
        for pid in pids:
            reading = read_cpu_times(pid)
            if reading is None:
                self._previous.pop(pid, None)  # gone: nothing to count
                continue
            cpu_s, start = reading
            before = self._previous.get(pid)
            if before is None or before[1] != start or before[0] > cpu_s:
                before = (0.0, start, start)  # new pid (or a reused one): measure since it began
            self._previous[pid] = (cpu_s, start, now)
            elapsed = now - before[2]
            if elapsed > 0:
                total += (cpu_s - before[0]) / elapsed
        return total

    def retain(self, pids: Iterable[int]) -> None:
        """Forget every pid not in `pids`, so the sampler does not grow with finished jobs."""
        keep = set(pids)
        for pid in [p for p in self._previous if p not in keep]:
            del self._previous[pid]


def virtual_inventory(count: int, pids_by_device: dict[str, list[int]], sampler: CpuSampler) -> list[DeviceInfo]:
    """`count` CPU-backed devices, with the measured memory and CPU of the processes on each.

    `pids_by_device` maps a virtual uuid to the pids of the job ranks running on it.
    """
    if count < 1:
        raise UserError(f"the number of virtual GPUs must be at least 1, not {count}")
    # A virtual device's memory is a share of the machine's RAM, not a physical size: the ranks
    # of all devices draw from the same RAM, and this is the part a fair split gives each.
    share_bytes = machine_memory() // count
    # Utilisation is the CPU the device's processes use, as a percentage of the device's fair
    # share of the cores (cores / count), capped at 100: "100%" means it uses all it should.
    share_cores = usable_cores() / count
    devices = []
    for i in range(count):
        uuid = virtual_uuid(i)
        processes = []
        for pid in pids_by_device.get(uuid, []):
            rss = read_rss(pid)
            if rss is not None:
                processes.append((pid, rss))
        used = sum(rss for _, rss in processes)
        cores = sampler.cores_used([pid for pid, _ in processes])
        devices.append(DeviceInfo(
            index=i, uuid=uuid, name=f"Virtual GPU {i} (CPU-backed)", virtual=True, available=True,
            memory_total=share_bytes, memory_used=used, memory_free=share_bytes - used,
            utilization_pct=min(100.0, 100.0 * cores / share_cores),
            temperature_c=None, power_w=None, power_limit_w=None,  # unknown, never invented
            processes=processes, pci_bus_id=None))
    sampler.retain(pid for pids in pids_by_device.values() for pid in pids)
    return devices


VIRTUAL_PREFIX = "virtual-"  # every virtual device's uuid starts so


def virtual_uuid(i: int) -> str:
    return f"{VIRTUAL_PREFIX}{i}"


def virtual_device_threads(cores: int, count: int) -> int:
    """Torch threads for a rank on one of `count` virtual devices: its share of the cores. Each job
    sizing its threads to the whole machine would oversubscribe it as soon as two jobs run, and
    OpenMP threads spin when oversubscribed (measured: 5-6x the CPU for the same work)."""
    return max(1, cores // max(1, count))


def virtual_count() -> int:
    """How many virtual devices to offer: $SAE_DIST_VIRTUAL_GPUS, else 2."""
    raw = os.environ.get(VIRTUAL_ENV_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_VIRTUAL_GPUS
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_VIRTUAL_GPUS:
        raise UserError(f"{VIRTUAL_ENV_VAR}={raw!r}: give a whole number of virtual GPUs "
                        f"from 1 to {MAX_VIRTUAL_GPUS}, or unset it for {DEFAULT_VIRTUAL_GPUS}")
    return n


def inventory(pids_by_device: dict[str, list[int]] | None = None, sampler: CpuSampler | None = None,
              *, virtual: int | None = None) -> list[DeviceInfo]:
    """The machine's devices: NVML's GPUs when it finds any, else virtual ones.

    `virtual=N`, or SAE_DIST_VIRTUAL_GPUS set explicitly, asks for N virtual devices whatever
    the hardware (the daemon's flag, tests, trying the product on a GPU machine).
    Keep one `sampler` across calls for utilisation measured between them.
    """
    if virtual is None and os.environ.get(VIRTUAL_ENV_VAR, "").strip():
        virtual = virtual_count()
    if virtual is None:
        gpus = nvml_inventory()
        if gpus:
            return gpus
        virtual = virtual_count()
        _tell_fallback(virtual)
    return virtual_inventory(virtual, pids_by_device or {}, sampler or CpuSampler())

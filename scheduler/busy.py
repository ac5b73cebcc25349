"""Is each device free? A pure decision from one inventory and the scheduler's own records.

A GPU can be held by one of our jobs, used by someone else's process (a notebook, another
user's training), or unreadable. The scheduler must never start a job on a device that something
else is using, and `info` must say why a device is not free, so the verdict and its reason are
decided here, in one place, from plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from scheduler.devices import DeviceInfo

MIB = 2**20
# Below this, memory in use without a process we can see is driver/context noise, not a user.
DEFAULT_MEMORY_THRESHOLD = 512 * MIB
# A job's ranks start (and allocate memory) before we learn all their pids.
DEFAULT_GRACE_S = 30.0

State = Literal["idle", "allocated", "busy", "unavailable"]


@dataclass(frozen=True)
class DeviceState:
    state: State
    job_id: int | None  # the job holding the device, when allocated
    reason: str  # a short sentence for people


def _pids(pids: list[int]) -> str:
    listed = ", ".join(map(str, pids))
    return f"used by pid {listed}, not a scheduler job" if len(pids) == 1 else \
        f"used by pids {listed}, not scheduler jobs"


def classify_one(device: DeviceInfo, job_id: int | None, job_started_at: float | None, our_pids: set[int],
                 now: float, memory_threshold_bytes: int = DEFAULT_MEMORY_THRESHOLD,
                 grace_s: float = DEFAULT_GRACE_S) -> DeviceState:
    """The state of one device; see `classify`."""
    if not device.available:
        return DeviceState("unavailable", None, device.error or "cannot be read")
    foreign = sorted(pid for pid, _ in device.processes if pid not in our_pids)
    if job_id is not None:
        # Allocated wins: the job holds the device. After its start-up window, a process we do not
        # know on it is worth telling (someone shares the job's GPU); before, it is the job's own
        # ranks starting, whose pids we have not recorded yet.
        starting = job_started_at is None or now - job_started_at < grace_s
        if foreign and not starting:
            return DeviceState("allocated", job_id, f"job {job_id}; also {_pids(foreign)}")
        return DeviceState("allocated", job_id, f"job {job_id}")
    if foreign:
        return DeviceState("busy", None, _pids(foreign))
    # One of our jobs' processes on a device no job holds: it went around CUDA_VISIBLE_DEVICES
    # (a script that sets it, a library that ignores it). Its memory and compute are real: busy.
    strays = sorted(pid for pid, _ in device.processes if pid in our_pids)
    if strays and not device.virtual:
        listed = ", ".join(map(str, strays))
        return DeviceState("busy", None, f"used by pid{'s' if len(strays) > 1 else ''} {listed} of a scheduler "
                                         "job, outside the devices it was given")
    # A virtual device's memory figure is our own ranks' resident memory, never someone else's;
    # on a GPU no job holds, none of our processes runs (else it is busy above): all is another's.
    if not device.virtual and device.memory_used is not None and device.memory_used > memory_threshold_bytes:
        return DeviceState("busy", None, f"{device.memory_used // MIB} MiB in use by something else")
    return DeviceState("idle", None, "free")


def classify(devices: list[DeviceInfo], allocations: dict[str, int], job_started_at: dict[int, float],
             our_pids: set[int], now: float, memory_threshold_bytes: int = DEFAULT_MEMORY_THRESHOLD,
             grace_s: float = DEFAULT_GRACE_S) -> dict[str, DeviceState]:
    """Each device's state, by uuid.

    - unavailable: NVML could not read it (the reason is its error);
    - allocated: one of our jobs holds it (`allocations`: uuid -> job id); its reason also names
      unknown processes on it once the job is past its start-up grace window
      (`job_started_at`: job id -> start time, same clock as `now`);
    - busy: not ours, and a compute process not in `our_pids` runs on it, or one of ours (a job's
      process outside its allocation), or more than `memory_threshold_bytes` are used by
      something other than our processes;
    - idle otherwise.
    """
    return {
        d.uuid: classify_one(d, allocations.get(d.uuid), job_started_at.get(allocations.get(d.uuid, -1)),
                             our_pids, now, memory_threshold_bytes, grace_s)
        for d in devices
    }

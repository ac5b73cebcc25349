"""Is a failed device healthy again? Probes in subprocesses, and clearing the faults of those
that pass.

`info --recheck` probes every failed device now and waits for the answers; the daemon's
`HealthChecker` probes each one at most every SAE_DIST_FAULT_RECHECK_S seconds without ever
blocking a scheduling pass (it starts a probe, and looks for its answer on later passes).
A probe is `python -m scheduler.probe UUID` (see that module) with a time limit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from sqlalchemy.engine import Engine

from scheduler.devices import UNKNOWN_PREFIX, VIRTUAL_PREFIX, DeviceInfo
from scheduler.faults import CLEARED_REASON, Fault, device_faults, faults_due
from scheduler.probe import CHECKED, HEALTHY

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0
"""A probe that has not answered by then counts as failed (importing torch and starting CUDA
take seconds on a loaded machine; a hung GPU takes forever)."""
OUTPUT_KEPT = 64 * 1024  # bytes of a probe's output kept (its end)


@dataclass(frozen=True)
class ProbeResult:
    device_uuid: str
    healthy: bool
    detail: str  # why it failed (the probe's last line), or "health check passed"


def probe_command(uuid: str, base_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the probe of one device."""
    env = dict(os.environ if base_env is None else base_env)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # A real GPU by its uuid, alone; a virtual device must not touch any GPU.
    env["CUDA_VISIBLE_DEVICES"] = "" if uuid.startswith(VIRTUAL_PREFIX) else uuid
    return [sys.executable, "-m", "scheduler.probe", uuid], env


def verdict(uuid: str, output: str) -> ProbeResult:
    """Healthy when the probe's last line is HEALTHY. Judged from the output, not the exit
    code: the daemon reaps every child it has, probes included, and a child reaped by someone
    else reads as exit code 0."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if lines and lines[-1] == HEALTHY:
        # A probe that could not check everything says what it did check, and the cleared
        # fault keeps it: "health check passed (checked: NVML only ...)".
        note = lines[-2] if len(lines) > 1 and lines[-2].startswith(CHECKED) else None
        return ProbeResult(uuid, True, f"{CLEARED_REASON} ({note})" if note else CLEARED_REASON)
    return ProbeResult(uuid, False, lines[-1] if lines else "the probe ended without a word")


class Probe:
    """One probe process of one device, started now; `result()` is None until it has ended."""

    def __init__(self, uuid: str, timeout_s: float = PROBE_TIMEOUT_S):
        argv, env = probe_command(uuid)
        self.device_uuid = uuid
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.output = b""
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        # Read without ever waiting: a full pipe must not stall the probe, nor a process the probe
        # left holding the pipe open stall the daemon's pass.
        os.set_blocking(self.proc.stdout.fileno(), False)

    def result(self) -> ProbeResult | None:
        self._drain()
        if self.proc.poll() is None:
            if time.monotonic() < self.deadline:
                return None
            self.stop()
            return ProbeResult(self.device_uuid, False, f"no answer within {self.timeout_s:g} s")
        self._drain()
        self.proc.stdout.close()
        return verdict(self.device_uuid, self.output.decode(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def _drain(self) -> None:
        if self.proc.stdout.closed:
            return
        while True:
            try:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
            except BlockingIOError:  # nothing more for now
                return
            if not chunk:  # end of the output
                return
            self.output = (self.output + chunk)[-OUTPUT_KEPT:]  # the verdict needs the end only


def lost_to_record(devices: list[DeviceInfo], faults: dict[str, Fault],
                   allocations: dict[str, int]) -> list[tuple[str, str, int | None]]:
    """(uuid, reason, job holding it) of each GPU NVML reports lost (fallen off the bus, or in
    need of a reset) that has no open fault yet: such a GPU stays failed until a health check
    passes, where a passing read error leaves it unavailable for that read only. A GPU never
    identified (no uuid yet) cannot carry a fault."""
    return [(d.uuid, f"NVML: {d.error}", allocations.get(d.uuid)) for d in devices
            if d.lost and d.uuid not in faults and not d.uuid.startswith(UNKNOWN_PREFIX)]


def record_lost(engine: Engine, devices: list[DeviceInfo], faults: dict[str, Fault],
                allocations: dict[str, int]) -> dict[str, Fault]:
    """Record a fault for each newly lost GPU (see `lost_to_record`); the open faults after."""
    todo = lost_to_record(devices, faults, allocations)
    if not todo:
        return faults
    from sae_dist.db import record_fault

    for uuid, reason, job_id in todo:
        log.error("device %s is lost (%s); failed until a health check passes", uuid, reason)
        record_fault(engine, uuid, reason, job_id=job_id)
    return device_faults(engine)


def settle(engine: Engine, result: ProbeResult) -> bool:
    """Clear the device's faults when its probe passed (True), else log why it still fails."""
    if result.healthy:
        from sae_dist.db import clear_faults

        cleared = clear_faults(engine, result.device_uuid, result.detail)
        log.info("device %s: %s, %d fault(s) cleared", result.device_uuid, result.detail, cleared)
        return True
    log.warning("device %s: still failing its health check: %s", result.device_uuid, result.detail)
    return False


def probe_all(uuids: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbeResult]:
    """Probe the devices at once and wait for every answer (in the order given)."""
    probes = [Probe(uuid, timeout_s) for uuid in uuids]
    results: dict[str, ProbeResult] = {}
    while len(results) < len(probes):
        for probe in probes:
            if probe.device_uuid not in results:
                result = probe.result()
                if result is not None:
                    results[probe.device_uuid] = result
        time.sleep(0.05)
    return [results[uuid] for uuid in uuids]


def recheck_now(engine: Engine, timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbeResult]:
    """Probe every failed device now, clear the faults of those that pass (`info --recheck`)."""
    results = probe_all(sorted(device_faults(engine)), timeout_s)
    for result in results:
        settle(engine, result)
    return results


class HealthChecker:
    """The daemon's health checks: each failed device is probed at most every `interval_s`
    seconds, one probe per device at a time; a pass starts probes and collects answers, never
    waits for one."""

    def __init__(self, interval_s: float, timeout_s: float = PROBE_TIMEOUT_S):
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.running: dict[str, Probe] = {}
        self.last_probed: dict[str, float] = {}  # uuid -> epoch seconds its last probe started

    def collect(self, engine: Engine) -> list[str]:
        """Settle the probes that have ended; returns the devices found healthy."""
        healthy = []
        for uuid, probe in list(self.running.items()):
            result = probe.result()
            if result is None:
                continue
            del self.running[uuid]
            if settle(engine, result):
                healthy.append(uuid)
        return healthy

    def start_due(self, faults: dict[str, Fault], now: float) -> list[str]:
        """Start a probe on every failed device that is due one; returns their uuids."""
        # Forget devices no longer failed: a new fault of theirs waits from its own detection.
        self.last_probed = {u: t for u, t in self.last_probed.items() if u in faults}
        due = faults_due(faults, self.last_probed, now, self.interval_s, self.running)
        for uuid in due:
            log.info("device %s: %s; probing its health", uuid, faults[uuid].describe())
            self.running[uuid] = Probe(uuid, self.timeout_s)
            self.last_probed[uuid] = now
        return due

    def stop(self) -> None:
        """Kill the probes still running (the daemon is stopping)."""
        for probe in self.running.values():
            probe.stop()
        self.running.clear()

"""A device a training rank died on is failed: out of new jobs until a health check passes.

The trainer's launcher records the fault (`sae_dist.db.record_fault`); here are the scheduler's
decisions about it, pure functions of plain data: what the inventory says about a failed
device (unavailable, with the fault as its reason: the same path an NVML read error takes, so
the policy, `info`, `recommend` and the app all follow), and which faults are due for a health
check. The probe itself and clearing the fault live in `scheduler.health`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Iterable

from sae_dist.errors import UserError
from scheduler.devices import DeviceInfo

RECHECK_ENV_VAR = "SAE_DIST_FAULT_RECHECK_S"
DEFAULT_RECHECK_S = 300.0
CLEARED_REASON = "health check passed"


@dataclass(frozen=True)
class Fault:
    """A device's open faults, summed up: the first one (what failed, where, since when) and
    when the newest was recorded (a fresh failure restarts the wait before a health check)."""

    device_uuid: str
    reason: str
    since: datetime  # the first open fault's detection
    latest: datetime  # the newest open fault's detection
    job_id: int | None = None
    run_id: int | None = None
    rank: int | None = None

    def describe(self) -> str:
        """"failed in job 7 (rank 1) since 2026-01-02 10:00:03 UTC: CUDA error ..." for people."""
        where = ""
        if self.job_id is not None:
            where = f" in job {self.job_id}" + (f" (rank {self.rank})" if self.rank is not None else "")
        elif self.rank is not None:
            where = f" on rank {self.rank}"
        when = _utc(self.since).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"failed{where} since {when}: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, for `info --json`."""
        return {"reason": self.reason, "job_id": self.job_id, "run_id": self.run_id, "rank": self.rank,
                "since": _utc(self.since).isoformat(timespec="seconds"), "description": self.describe()}


def faults_by_device(rows: Iterable[Any]) -> dict[str, Fault]:
    """One `Fault` per device from open fault rows (anything with DeviceFault's attributes)."""
    grouped: dict[str, list[Any]] = {}
    for row in rows:
        grouped.setdefault(row.device_uuid, []).append(row)
    out = {}
    for uuid, faults in grouped.items():
        first = min(faults, key=lambda f: (_utc(f.detected_at), f.id or 0))
        out[uuid] = Fault(device_uuid=uuid, reason=first.reason, since=_utc(first.detected_at),
                          latest=max(_utc(f.detected_at) for f in faults), job_id=first.job_id,
                          run_id=first.run_id, rank=first.rank)
    return out


def apply_faults(devices: list[DeviceInfo], faults: dict[str, Fault]) -> list[DeviceInfo]:
    """The inventory with each failed device unavailable, its fault first in `error` (which
    becomes its state's reason) and kept in `fault`. Devices without a fault are unchanged."""
    out = []
    for device in devices:
        fault = faults.get(device.uuid)
        if fault is None:
            out.append(device)
            continue
        error = fault.describe() + (f"; {device.error}" if device.error else "")
        out.append(replace(device, available=False, error=error, fault=fault))
    return out


def faults_due(faults: dict[str, Fault], last_probed: dict[str, float], now: float, interval_s: float,
               probing: Iterable[str] = ()) -> list[str]:
    """The failed devices to probe now (uuids, sorted): no probe running on them, none started in
    the last `interval_s`, and their newest fault at least `interval_s` old (a device that failed
    a second ago is not worth asking yet). Times are epoch seconds."""
    busy = set(probing)
    due = []
    for uuid, fault in faults.items():
        last = max(fault.latest.timestamp(), last_probed.get(uuid, -math.inf))
        if uuid not in busy and now - last >= interval_s:
            due.append(uuid)
    return sorted(due)


def recheck_interval_s(environ: dict[str, str] | None = None) -> float:
    """Seconds between health checks of a failed device: $SAE_DIST_FAULT_RECHECK_S, else 300."""
    raw = (os.environ if environ is None else environ).get(RECHECK_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_RECHECK_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{RECHECK_ENV_VAR}={raw!r}: give the seconds between health checks of a failed "
                        f"device, a number above 0 (e.g. 60), or unset it for {DEFAULT_RECHECK_S:.0f}")
    return value


def device_faults(engine) -> dict[str, Fault]:
    """The open faults in the database, one per device."""
    from sae_dist.db import active_faults

    return faults_by_device(active_faults(engine))


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes for what was stored as UTC.
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)

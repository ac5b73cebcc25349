"""What `info`, `recommend` and `metrics` show, read with plain SQL: the same answer as
`scheduler.status.devices_now` and `latest_samples`, without importing SQLAlchemy.

Importing SQLAlchemy and the schema costs a process ~0.4 s; `info` should answer in a fraction
of that. The rows come through `sae_dist.job_listing.query` (the SQLite file read by the
standard library, or the regular engine where that cannot answer); the decisions are the
shared pure ones (`scheduler.busy.classify`, `scheduler.faults`). A test holds the two views equal.
"""

from __future__ import annotations

import json
import time
from collections import namedtuple
from typing import Any

from sae_dist.job_listing import query, utc_time
from scheduler.busy import DeviceState, classify
from scheduler.devices import DeviceInfo, inventory
from scheduler.faults import Fault, apply_faults, faults_by_device

SAMPLE_FRESH_S = 10.0
"""A daemon sample older than this is not "now" (as scheduler.status.SAMPLE_FRESH_S)."""

RunningJob = namedtuple("RunningJob", "id devices_json pid pgid proc_start_ticks started_at")
FaultRow = namedtuple("FaultRow", "id device_uuid reason detected_at job_id run_id rank")
DeviceRow = namedtuple("DeviceRow", "uuid index name virtual available error memory_total pci_bus_id")
"""A row of the `devices` table: the daemon's latest inventory of a device (memory_total in bytes)."""
SAMPLE_READINGS = ("utilization_pct", "memory_used", "memory_total", "memory_free", "temperature_c", "power_w")
"""What a `gpu_samples` row measured (None: not measured); memory in bytes."""


def devices_now(now: float | None = None) -> tuple[list[DeviceInfo], dict[str, DeviceState], dict[str, int]]:
    """(devices, state by uuid, allocations uuid -> job id), as `scheduler.status.devices_now`."""
    from scheduler.procs import job_pids, pids_by_device

    allocations = {uuid: job_id for uuid, job_id in query(
        'SELECT "device_uuid", "job_id" FROM "allocations" WHERE "released_at" IS NULL ORDER BY "id"', {})}
    running = [RunningJob(*row[:5], utc_time(row[5])) for row in query(
        'SELECT "id", "devices_json", "pid", "pgid", "proc_start_ticks", "started_at" FROM "jobs" '
        'WHERE "state" = \'RUNNING\' ORDER BY "id"', {})]
    devices = apply_faults(inventory(pids_by_device(running), None), open_faults())
    started = {j.id: j.started_at.timestamp() for j in running if j.started_at}
    ours = {p for j in running for p in job_pids(j)}
    states = classify(devices, allocations, started, ours, time.time() if now is None else now)
    return devices, states, allocations


def open_faults() -> dict[str, Fault]:
    """The open device faults, one per device (as `scheduler.faults.device_faults`)."""
    rows = query('SELECT "id", "device_uuid", "reason", "detected_at", "job_id", "run_id", "rank" '
                 'FROM "device_faults" WHERE "cleared_at" IS NULL ORDER BY "id"', {})
    return faults_by_device(FaultRow(r[0], r[1], r[2], utc_time(r[3]), *r[4:]) for r in rows)


def latest_samples(now: float | None = None, max_age_s: float = SAMPLE_FRESH_S) -> dict[str, dict[str, Any]]:
    """The newest daemon sample of each device when at most `max_age_s` old, by uuid: its
    time and its readings (SAMPLE_READINGS; `info` shows the utilisation, `metrics` all)."""
    now = time.time() if now is None else now
    readings = ", ".join(f's."{name}"' for name in SAMPLE_READINGS)
    rows = query(f'SELECT s."device_uuid", s."time", {readings} FROM "gpu_samples" s JOIN '
                 '(SELECT "device_uuid", max("id") AS "id" FROM "gpu_samples" GROUP BY "device_uuid") n '
                 'ON s."id" = n."id"', {})
    out = {}
    for uuid, when, *values in rows:
        moment = utc_time(when)
        if moment is not None and moment.timestamp() > now - max_age_s:
            out[uuid] = {"device_uuid": uuid, "time": moment, **dict(zip(SAMPLE_READINGS, values))}
    return out


def device_table() -> list[DeviceRow]:
    """The `devices` table, by index: what the daemon last read of each device (the live
    inventory is `devices_now`'s)."""
    rows = query('SELECT "uuid", "index", "name", "virtual", "available", "error", "memory_total", "pci_bus_id" '
                 'FROM "devices" ORDER BY "index", "uuid"', {})
    return [DeviceRow(r[0], r[1], r[2], bool(r[3]), bool(r[4]), *r[5:]) for r in rows]


def device_sharers(engine=None) -> dict[str, list[dict]]:
    """Each shared device's shared jobs as the daemon last saw them (`sharers_json`: job,
    declared and measured memory, whether it uses more than it declared), by uuid; through
    `engine` where one is open (the app's pages)."""
    rows = query('SELECT "uuid", "sharers_json" FROM "devices" WHERE "sharers_json" IS NOT NULL', {}, engine)
    return {uuid: json.loads(text) for uuid, text in rows}


def sharing_text(sharers: list[dict], memory_total: int | None, fmt) -> str:
    """`info`'s words for a shared device: its jobs with their declared memory (and what each
    uses where it is over), and the memory left to declare."""
    parts = []
    for s in sharers:
        over = f", uses {fmt(s['used'])}: OVER its --mem" if s.get("over") else ""
        parts.append(f"job {s['job']} ({fmt(s['declared'])}{over})")
    declared = sum(s["declared"] or 0 for s in sharers)
    left = f"; {fmt(memory_total - declared)} of {fmt(memory_total)} left" if memory_total else ""
    return f"shared: {', '.join(parts)}{left}"

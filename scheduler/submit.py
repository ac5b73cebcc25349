"""Putting a validated job on the queue from Python (the app), and the one-click demo job.

A `JobSpec` is valid once it exists (scheduler.spec checks every field); here its devices are
resolved against this machine's, it is stored PENDING, and a daemon is started or woken so it
runs without anyone typing `python -m scheduler daemon` (SAE_DIST_AUTOSTART=0: no start).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine

from scheduler.array_submit import jobs_to_store
from scheduler.arrays import ArraySpec
from scheduler.devices import DeviceInfo
from scheduler.spec import JobSpec, check_memory_fits
from scheduler.store import submit, submit_array

DEMO_DEVICES = 2
"""The demo trains on this many devices when they are free (else on 1)."""


def submit_spec(engine: Engine, spec: JobSpec, devices: list[DeviceInfo] | None = None,
                array: ArraySpec | None = None, overrides: list[dict] | None = None) -> int:
    """Queue `spec` (its gpu_ids checked against `devices`, default the live inventory; with
    `array`, a task per task id) and make sure a daemon will act on it. Returns the job id (an
    array's id)."""
    from scheduler.control import ensure_daemon

    if devices is None:
        from scheduler.devices import inventory

        devices = inventory({}, None)
    check_memory_fits(spec, [d.memory_total for d in devices])
    tasks = jobs_to_store(spec, [(d.index, d.uuid) for d in devices], array, overrides)
    job_id = submit(engine, tasks[0][1]) if array is None else submit_array(engine, tasks)
    ensure_daemon()
    return job_id


def demo_config(name: str) -> dict[str, Any]:
    """A small synthetic TopK training that shows every chart within a minute and ends in a
    few on CPU: 64-wide activations drawn from 128 planted features, 256 latents, k = 8."""
    return {"name": name, "architecture": "topk", "source": "synthetic", "d_in": 64,
            "expansion_factor": 4, "k": 8, "synthetic_features": 128, "batch_size": 256,
            "steps": 3000, "log_every": 10, "checkpoint_every": 1000}


def submit_demo(engine: Engine, workdir: str, now: datetime | None = None) -> tuple[int, list[str]]:
    """Queue the demo training on DEMO_DEVICES free devices (1 if fewer are free; on the first
    to free up if none is). Returns (job id, device uuids asked for; [] = any one)."""
    from scheduler.recommend import recommend
    from scheduler.status import devices_now

    devices, states, _ = devices_now(engine)
    chosen: list[str] = []
    for count in (DEMO_DEVICES, 1):
        rec = recommend(devices, states, count, None)
        if rec.error is None:
            chosen = rec.chosen
            break
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    spec = JobSpec(kind="train", train_config=demo_config(f"demo-{stamp}"), name=f"demo-{stamp}",
                   gpu_ids=chosen or None, gpus=None if chosen else 1, workdir=workdir)
    return submit_spec(engine, spec, devices), chosen

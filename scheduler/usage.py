"""What a job used, from the daemon's device samples: utilisation, peak memory, energy.

Energy integrates power over time between consecutive samples of one device (a gap longer
than MAX_GAP_S, e.g. the daemon was down, is not counted rather than guessed). A device with no
power reading (virtual ones) gives no energy: unknown, not zero.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from sqlalchemy import select

from sae_dist.db import GpuSample

MAX_GAP_S = 5.0


def summarize(samples: list[tuple[str, float, float | None, int | None, float | None]]) -> dict:
    """Usage of one job from (device, time s, utilisation %, memory used, power W) samples."""
    utils = [u for _, _, u, _, _ in samples if u is not None]
    mems = [m for _, _, _, m, _ in samples if m is not None]
    by_device: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    for device, t, _, _, power in samples:
        by_device[device].append((t, power))
    energy_j, measured = 0.0, False
    for points in by_device.values():
        # By time only (a None power cannot be compared); at one instant a reading without power
        # goes first, so it never splits a measured interval.
        points.sort(key=lambda point: (point[0], point[1] is not None))
        for (t0, p0), (t1, p1) in zip(points, points[1:]):
            if p0 is None or p1 is None or t1 - t0 > MAX_GAP_S:
                continue
            energy_j += (p0 + p1) / 2 * (t1 - t0)
            measured = True
    return {
        "mean_util_pct": fmean(utils) if utils else None,
        "peak_util_pct": max(utils) if utils else None,
        "peak_memory_bytes": max(mems) if mems else None,
        "energy_wh": energy_j / 3600 if measured else None,
        "samples": len(samples),
    }


def job_usage(engine, job_ids: list[int]) -> dict[int, dict]:
    if not job_ids:
        return {}
    t = GpuSample.__table__
    rows: dict[int, list] = defaultdict(list)
    with engine.connect() as conn:
        for i in range(0, len(job_ids), 500):
            query = select(t.c.job_id, t.c.device_uuid, t.c.time, t.c.utilization_pct, t.c.memory_used, t.c.power_w)\
                .where(t.c.job_id.in_(job_ids[i:i + 500]))
            for r in conn.execute(query):
                rows[r.job_id].append((r.device_uuid, r.time.timestamp(), r.utilization_pct, r.memory_used, r.power_w))
    return {job_id: summarize(samples) for job_id, samples in rows.items()}

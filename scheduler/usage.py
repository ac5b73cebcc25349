"""What a job used, from the daemon's device samples: utilisation, peak memory, energy.

Energy integrates power over time between consecutive samples of one device (a gap longer
than MAX_GAP_S, e.g. the daemon was down, is not counted rather than guessed). A device with no
power reading (virtual ones) gives no energy: unknown, not zero.
"""

from __future__ import annotations

from collections import defaultdict

from sae_dist.job_listing import query, utc_time

MAX_GAP_S = 5.0
CHUNK = 500  # job ids per query


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
        "mean_util_pct": sum(utils) / len(utils) if utils else None,  # statistics costs acct 4 ms
        "peak_util_pct": max(utils) if utils else None,
        "peak_memory_bytes": max(mems) if mems else None,
        "energy_wh": energy_j / 3600 if measured else None,
        "samples": len(samples),
    }


def job_usage(engine, job_ids: list[int] | None) -> dict[int, dict]:
    """Each job's usage (see `summarize`), for `job_ids` (None: every job with samples). Read
    with plain SQL: without `engine`, from the SQLite state file by the standard library, so
    `acct` does not pay for importing SQLAlchemy."""
    columns = 'SELECT "job_id", "device_uuid", "time", "utilization_pct", "memory_used", "power_w" FROM "gpu_samples"'
    if job_ids is None:
        chunks = [query(columns + ' WHERE "job_id" IS NOT NULL', {}, engine)]
    else:
        chunks = []
        for i in range(0, len(job_ids), CHUNK):
            names = {f"j{k}": job_id for k, job_id in enumerate(job_ids[i:i + CHUNK])}
            chunks.append(query(f'{columns} WHERE "job_id" IN ({", ".join(":" + n for n in names)})', names, engine))
    rows: dict[int, list] = defaultdict(list)
    for chunk in chunks:
        for job_id, device, time, util, memory, power in chunk:
            rows[job_id].append((device, utc_time(time).timestamp(), util, memory, power))
    return {job_id: summarize(samples) for job_id, samples in rows.items()}

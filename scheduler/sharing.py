"""Shared devices (`submit --shared`): what the shared jobs on each device declared, and what
they use, measured per process (NVML's per-process memory on GPUs, resident memory on virtual
devices). Pure: the daemon gives it its views and readings, and writes the result where
`info`, `queue` and the app read it (the devices table's `sharers_json`).
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.policy import JobView

MIB = 2**20


def shared_use(running: Iterable[JobView]) -> dict[str, int | None]:
    """Device uuid -> the memory the shared jobs on it declared; None where an unshared job holds
    it as well (then nothing may join it). Devices no shared job holds are absent."""
    use: dict[str, int | None] = {}
    whole: set[str] = set()
    for job in running:
        for uuid in job.devices:
            if job.shared and job.mem_per_gpu is not None:
                if use.get(uuid, 0) is not None:
                    use[uuid] = (use.get(uuid) or 0) + job.mem_per_gpu
            else:
                whole.add(uuid)
    return {u: (None if u in whole else v) for u, v in use.items()}


def sharers(uuid: str, processes: list[tuple[int, int | None]], running: Iterable[JobView],
            pids: dict[int, list[int]]) -> list[dict]:
    """The shared jobs on one device: {job, declared, used, over}; `used` sums the memory of the
    job's processes on it (MiB-rounded bytes; None when a reading is missing or none is seen yet),
    `over` is whether it passes what the job declared."""
    per_pid = dict(processes)
    out = []
    for job in running:
        if not (job.shared and uuid in job.devices):
            continue
        mine = [per_pid[p] for p in pids.get(job.id, []) if p in per_pid]
        used = None if not mine or any(m is None for m in mine) else sum(mine) // MIB * MIB
        out.append({"job": job.id, "declared": job.mem_per_gpu, "used": used,
                    "over": used is not None and job.mem_per_gpu is not None and used > job.mem_per_gpu})
    return out

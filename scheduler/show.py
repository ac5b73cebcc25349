"""`show JOB`: one job whole, as `scontrol show job` prints it: Key=Value fields on a few
indented lines, with SLURM's names where SLURM has the field (JobState, Reason, StdOut...).
A pure function of the job's fields, so what it says is tested on plain data."""

from __future__ import annotations

import json
import shlex
from datetime import datetime
from typing import Any

TIMES = {"SubmitTime", "BeginTime", "StartTime", "EndTime"}  # None reads Unknown (BeginTime: None)


def show_fields(job: dict[str, Any], now: datetime, command: list[str], stdout: str,
                stderr: str) -> list[list[tuple[str, Any]]]:
    """The job's fields, a line's worth each: (key, value) pairs, the values as JSON has them
    (None where there is none). `job` holds the columns of the jobs table; `command` is what it
    runs (a training: its settings as flags, --devices set at start); `stdout` and `stderr` are
    the files its output goes (or will go) to."""
    started, ended = job["started_at"], job["ended_at"]
    deps = json.loads(job.get("dependencies_json") or "[]")
    lines = [
        [("JobId", job["id"]), ("JobName", job["name"]), ("UserId", job["user"]), ("Kind", job["kind"])],
        [("JobState", job["state"]), ("Reason", job["reason"]),
         ("ExitCode", f"{job['exit_code'] or 0}:{job['signal'] or 0}" if ended else None),
         ("Restarts", job["requeue_count"] or 0)],
        [("Priority", job["priority"]), ("Hold", bool(job["held"])), ("Requeue", bool(job["requeue_on_failure"])),
         ("Exclusive", bool(job["exclusive"])), ("Shared", bool(job["shared"])),
         ("Preemptible", bool(job["preemptible"]))],
        [("SubmitTime", _time(job["submitted_at"])), ("BeginTime", _time(job["begin_at"])),
         ("StartTime", _time(started)), ("EndTime", _time(ended)),
         *([("ExpectedStart", _time(job.get("expected_start_at")))] if job["state"] == "PENDING" else [])],
        [("RunTime", duration(((ended or now) - started).total_seconds()) if started else None),
         ("TimeLimit", duration(job["time_limit_s"]) if job["time_limit_s"] is not None else "UNLIMITED")],
        [("Gres", f"gpu:{job['gpus']}"), ("MemPerGPU", job["mem_per_gpu"]),
         ("GpuIds", json.loads(job["gpu_ids_json"]) if job["gpu_ids_json"] else None),
         ("Devices", json.loads(job["devices_json"]) if job["devices_json"] else None)],
        [("Dependency", [f"{kind}:{dep}" for kind, dep in deps] or None)],
    ]
    if job["array_job_id"] is not None:
        lines.append([("ArrayJobId", job["array_job_id"]), ("ArrayTaskId", job["array_task_id"]),
                      ("ArrayTaskThrottle", job["array_max_running"])])
    lines += [
        [("Command", shlex.join(command))],
        [("WorkDir", job["workdir"])],
        [("StdOut", stdout)], [("StdErr", stderr)],
    ]
    if job.get("snapshot_commit"):
        lines.append([("Snapshot", job["snapshot_commit"]), ("SnapshotDir", job.get("snapshot_dir"))])
    return lines


def show_text(fields: list[list[tuple[str, Any]]]) -> str:
    """The fields as scontrol prints them: the first line flush, the rest indented; a time not
    reached is Unknown, a flag yes or no, a list comma-separated, a size in binary units."""
    return "\n".join(("   " if i else "") + " ".join(f"{k}={_text(k, v)}" for k, v in line)
                     for i, line in enumerate(fields))


def _text(key: str, value: Any) -> str:
    if value is None:
        return "Unknown" if key in TIMES - {"BeginTime"} else "N/A" if key == "ExpectedStart" else "None"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(value)
    if key == "MemPerGPU":
        return _memory(value)
    return str(value)


def duration(seconds: float) -> str:
    """SLURM's [D-]HH:MM:SS."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


def _time(when: datetime | None) -> str | None:
    return when.replace(microsecond=0).isoformat() if when else None


def _memory(size: int) -> str:
    """SLURM's way where it is exact (20G, 512M), else MiB with a decimal."""
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B" if size < 2**20 else f"{size / 2**20:.1f}M"

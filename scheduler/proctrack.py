"""How a job's processes are tracked, and when they are all gone: the decisions, on plain data.

Two ways, as SLURM has them (proctrack/cgroup, proctrack/linuxproc):

- **cgroup**: where cgroup v2 is writable (root, a cgroup2 mount), each job runs in a cgroup of
  its own, `<cgroup2 mount>/sae-dist-<state key>/job-<id>`; its first process enters it before it
  can fork, so every process it ever starts is in it, detached (setsid, double fork) or not.
  The job has ended when the cgroup is empty (`cgroup.events`: "populated 0").
- **subreaper** (the fallback): the supervisor is the job's child subreaper, so orphans of the
  job re-parent to it, and every process of the job carries `SAE_DIST_JOB_MARK` in its
  environment; the job has ended when no process below the supervisor, of the job's process
  group, or with the job's mark is alive. A process that cleared its environment and detached
  while its supervisor was dead escapes it.

The file I/O is in `scheduler.cgroups`; this module only decides, so it is tested with plain values.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterable

from sae_dist.contract import JOB_MARK_ENV

CGROUPS_ENV = "SAE_DIST_CGROUPS"  # "0": no cgroups, the subreaper fallback (tests exercise it so)
JOB_PREFIX = "job-"


def state_key(home: str) -> str:
    """A short name for a state directory (its resolved path): its cgroups and its jobs' marks
    carry it, so two state directories on one machine never touch each other's jobs."""
    return hashlib.sha256(home.encode()).hexdigest()[:12]


def parent_name(key: str) -> str:
    return f"sae-dist-{key}"


def job_name(job_id: int) -> str:
    return f"{JOB_PREFIX}{job_id}"


def job_id_of(name: str) -> int | None:
    """The job id of a job cgroup's name, None for any other name."""
    rest = name[len(JOB_PREFIX):] if name.startswith(JOB_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def job_mark(key: str, job_id: int) -> str:
    """The value of SAE_DIST_JOB_MARK in every process of a job."""
    return f"{key}:{job_id}"


def mark_of(environ: bytes, name: str) -> str | None:
    """The value of `name` in a /proc/PID/environ (NUL-separated NAME=value), None without it."""
    prefix = name.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def cgroup2_mount(mounts: str) -> str | None:
    """Where the cgroup v2 hierarchy is mounted, from /proc/self/mounts; None without one.
    A mount point's spaces and the like are written as octal escapes there (`\\040`)."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return _unescape(fields[1])
    return None


def _unescape(path: str) -> str:
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and i + 3 < len(path) and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def own_cgroup(proc_cgroup: str) -> str | None:
    """A process's cgroup v2 path ("/a/b"), from /proc/PID/cgroup's "0::/a/b" line."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def why_not_cgroups(switch: str | None, euid: int, mount: str | None) -> str | None:
    """Why a job cannot have a cgroup here, or None when one may be tried (creating it can still
    fail: a read-only cgroupfs, a container's; then that failure is the reason)."""
    if switch == "0":
        return f"{CGROUPS_ENV}=0"
    if euid != 0:
        return "not root"
    if mount is None:
        return "no cgroup2 mount"
    return None


def in_a_job_cgroup(cgroup: str | None) -> bool:
    """Whether a cgroup path ("/sae-dist-k/job-3/x") lies in the job cgroup of some state
    directory: a daemon started from inside a job (a job's `submit` autostarts one)."""
    parts = (cgroup or "").strip("/").split("/")
    return len(parts) >= 2 and parts[0].startswith(parent_name("")) and job_id_of(parts[1]) is not None


def populated(events: str) -> bool:
    """cgroup.events' "populated" flag: whether a process (not a zombie) is in the cgroup or
    below it."""
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "populated":
            return value.strip() != "0"
    return False


def all_gone(populated_now: bool | None, alive: Iterable[int]) -> bool:
    """Whether every process of a job has ended: its cgroup (None: it has none) is empty and
    none of the processes found otherwise (its tree, group, mark) is alive."""
    return not populated_now and not any(True for _ in alive)


def stale_jobs(names: Iterable[str], running: set[int]) -> list[int]:
    """Job cgroups (names under a state directory's parent) of jobs that do not run: their job
    ended while no daemon ran, or their supervisor could not remove them. Sorted ids."""
    return sorted(i for i in map(job_id_of, names) if i is not None and i not in running)


def stale_marks(marked: dict[int, list[int]], running: set[int]) -> dict[int, list[int]]:
    """Processes carrying the mark of a job that does not run (job id -> pids)."""
    return {job_id: pids for job_id, pids in marked.items() if job_id not in running and pids}


SETTLE_S = 1.0  # without a cgroup, how long a job with no process found must stay so to be believed


def kill_signal(first_seen: float | None, now: float, grace_s: float) -> int | None:
    """What to send now to the processes of a job whose supervisor vanished, first seen so at
    `first_seen` (None: this pass): SIGTERM the first time, nothing during the grace, then
    SIGKILL on every pass until they are gone. Never a wait inside a pass."""
    if first_seen is None:
        return signal.SIGTERM
    return signal.SIGKILL if now >= first_seen + grace_s else None


def orphan_ended(populated_now: bool | None, alive: Iterable[int], first_seen: float | None, now: float) -> bool:
    """Whether every process of a job whose supervisor vanished has ended. With a cgroup
    (`populated_now` not None) its emptiness says so at once: a process its supervisor forked
    just before dying enters the cgroup before it runs anything, or fails to (the cgroup
    removed) and runs nothing. Without one, "nothing found" is believed only once it held for
    SETTLE_S: such a process carries the job's mark only once it has exec'd the job."""
    if not all_gone(populated_now, alive):
        return False
    return populated_now is not None or (first_seen is not None and now - first_seen >= SETTLE_S)


def describe(cgroup: str | None, why_not: str | None) -> str:
    """The supervisor's line on how a job's processes are tracked."""
    if cgroup is not None:
        return f"processes tracked in cgroup {cgroup}"
    return f"processes tracked by its supervisor as child subreaper and by {JOB_MARK_ENV} (no cgroup: {why_not})"

"""Processes by identity: a pid is only "ours" while its start time matches the one recorded.

Linux /proc only (the scheduler's platform). Start time is field 22 of /proc/PID/stat, in clock
ticks since boot: a pid reused by another program after a crash has a different one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

from sae_dist.contract import JOB_MARK_ENV, RANK_PROCESS_NAME
from scheduler.proctrack import mark_of

# Indices into `stat_fields` (field N of /proc/PID/stat is index N - 3).
_STATE, _PPID, _PGRP, _UTIME, _STIME, _START = 0, 1, 2, 11, 12, 19


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return stat.rpartition(")")[2].split()


def start_ticks(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[_START]) if fields else None


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(user + system CPU time, start time) of a process in clock ticks, or None when gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[_UTIME]) + int(fields[_STIME]), int(fields[_START])
    except (TypeError, IndexError, ValueError):
        return None


def is_alive(pid: int | None, ticks: int | None) -> bool:
    """True if pid runs and is the process we recorded (not a zombie, not a reused pid)."""
    if not pid:
        return False
    fields = stat_fields(pid)
    if not fields or (ticks is not None and int(fields[_START]) != ticks):
        return False
    return fields[_STATE] != "Z"


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (a /proc scan: /proc/PID/task/*/children is often absent)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(entry)):
            out[int(entry)] = int(fields[_PPID])
    return out


RANK_NAME = re.compile("^" + RANK_PROCESS_NAME.format(local_rank=r"(\d+)") + "$")


def local_rank(pid: int) -> int | None:
    """A training rank's LOCAL_RANK, or None for another process: from its environment, where
    torchrun sets it for a rank it spawns; else from its name, which a rank our launcher forked
    gives itself (its /proc environ is the launcher's: sae_dist/cli/forked_rank.py)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1] or 0)
    try:
        named = RANK_NAME.match(Path(f"/proc/{pid}/comm").read_text().strip())
    except OSError:
        return None
    return int(named.group(1)) if named else None


def own_open_files() -> dict[int, str]:
    """This process's open file descriptors and what each points to."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return out


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        kids.setdefault(parent, []).append(child)
    return kids


def descendants(pid: int, kids: dict[int, list[int]] | None = None,
                prune: Callable[[int], bool] | None = None) -> list[int]:
    """Every process below pid, whatever session it moved to (torchrun's ranks have their own).
    `kids` (parent -> children, from one /proc scan) saves the scan when asking for many; a
    process for which `prune` is true is left out, with everything below it."""
    kids = _children() if kids is None else kids
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if prune is not None and prune(child):
                continue
            found.append(child)
            todo.append(child)
    return found


def job_mark(pid: int) -> str | None:
    """The SAE_DIST_JOB_MARK a process was started with; None without one (or unreadable)."""
    try:
        return mark_of(Path(f"/proc/{pid}/environ").read_bytes(), JOB_MARK_ENV)
    except OSError:
        return None


def signal_group(pgid: int | None, sig: int) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def group_alive(pgid: int | None) -> bool:
    """Whether a process of the group runs. A zombie does not: killpg(pgid, 0) counts it, and
    where pid 1 reaps nothing (a container's shell) the zombie of a job whose supervisor died
    stays forever, and held its devices with it."""
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for entry in os.listdir("/proc"):
        fields = stat_fields(entry) if entry.isdigit() else None
        if fields and int(fields[_PGRP]) == pgid and fields[_STATE] != "Z":
            return True
    return False


def marked(key: str) -> dict[int, list[int]]:
    """job id -> the live processes whose environment carries SAE_DIST_JOB_MARK=<key>:<job id>
    (the state directory's key), from one /proc scan. The environment is the one each process
    was started with, so a job's process that re-execs itself with a clean environment is not
    found; another user's processes are found only by root. Neither this process nor its
    children are: a daemon started by hand inside a job has the job's mark, and the supervisors
    it forks share its environment."""
    prefix, me, out = f"{key}:", os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if JOB_MARK_ENV.encode() not in environ:
            continue
        mark = mark_of(environ, JOB_MARK_ENV) or ""
        fields = stat_fields(entry)
        if (mark.startswith(prefix) and mark[len(prefix):].isdigit() and fields and fields[_STATE] != "Z"
                and int(fields[_PPID]) != me):
            out.setdefault(int(mark[len(prefix):]), []).append(int(entry))
    return out


def wait_gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of pids runs (zombies count as gone); True if they all went."""
    deadline = time.monotonic() + timeout
    while True:
        if not any(is_alive(p, None) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def terminate_tree(root_pid: int, pgid: int | None, grace_s: float) -> None:
    """SIGTERM the job's process group and every descendant, SIGKILL what is left after grace_s."""
    tree = [root_pid, *descendants(root_pid)]
    signal_group(pgid, signal.SIGTERM)
    signal_pids(tree, signal.SIGTERM)
    if wait_gone(tree, grace_s):
        return
    tree = list({*tree, *descendants(root_pid)})
    signal_group(pgid, signal.SIGKILL)
    signal_pids(tree, signal.SIGKILL)
    wait_gone(tree, 5.0)


# ---- a job's processes (a job row: pid, proc_start_ticks, devices_json) ----

def job_pids(job) -> list[int]:
    """The job's processes now: its main process and every descendant (ranks included)."""
    if not job.pid or not is_alive(job.pid, job.proc_start_ticks):
        return []
    return [job.pid, *descendants(job.pid)]


def jobs_pids(jobs: list) -> dict[int, list[int]]:
    """job id -> `job_pids(job)` for each job, with one /proc scan for all of them."""
    live = [j for j in jobs if j.pid and is_alive(j.pid, j.proc_start_ticks)]
    kids = _children() if live else {}
    return {j.id: [j.pid, *descendants(j.pid, kids)] for j in live}


def pids_by_device(running: list, pids: dict[int, list[int]] | None = None) -> dict[str, list[int]]:
    """Which processes count on which device: a training rank on the device of its LOCAL_RANK;
    a job without ranks (a plain command, a one-device training in its launcher) wholly on its
    first device. The launcher of ranked jobs counts on none: it trains on no device, and on
    device 0 it doubled that device's memory beside rank 0's. `pids`: `jobs_pids(running)` when
    the caller has it already."""
    pids = jobs_pids(running) if pids is None else pids
    out: dict[str, list[int]] = {}
    for job in running:
        devices = json.loads(job.devices_json or "[]")
        if not devices:
            continue
        own = pids.get(job.id, [])
        ranked = {pid: r for pid in own if (r := local_rank(pid)) is not None and r < len(devices)}
        if not ranked:
            out.setdefault(devices[0], []).extend(own)
        for pid, rank in ranked.items():
            out.setdefault(devices[rank], []).append(pid)
    return out

"""Processes by identity: a pid is only "ours" while its start time matches the one recorded.

Linux /proc only (the scheduler's platform). Start time is field 22 of /proc/PID/stat, in clock
ticks since boot: a pid reused by another program after a crash has a different one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def is_alive(pid: int | None, ticks: int | None) -> bool:
    """True if pid runs and is the process we recorded (not a zombie, not a reused pid)."""
    if not pid:
        return False
    now = start_ticks(pid)
    if now is None or (ticks is not None and now != ticks):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (a /proc scan: /proc/PID/task/*/children is often absent)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below pid, whatever session it moved to (torchrun's ranks have their own)."""
    kids: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        kids.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


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
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


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

"""A job's processes, wherever they went: found, signalled, waited for until every one is gone.

The supervisor ends its job's processes through it (at a cancel, a time limit, and after the
job's main process exits), and the daemon those of a job whose supervisor vanished. With a
cgroup (`scheduler.cgroups`) the cgroup holds them all; without one (the fallback, see
`scheduler.proctrack`) they are what can be found: the process tree below a root (the job's
main process, or the supervisor that is the job's subreaper), its process group, and the
processes carrying the job's mark.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from scheduler import cgroups, procs, proctrack

log = logging.getLogger(__name__)

WAIT_STEP_S = 0.05


@dataclass
class JobProcesses:
    job_id: int
    cgroup: Path | None  # the job's cgroup (None: the fallback)
    root: int | None = None  # the processes below it are the job's: its supervisor (its subreaper)...
    root_ticks: int | None = None
    root_is_job: bool = False  # ... or the job's main process, itself one of them
    pgid: int | None = None  # the job's process group
    # Also look where the fallback looks when there is a cgroup: the daemon, for a job whose
    # supervisor died between making the cgroup and falling back (it could not enter it).
    thorough: bool = False
    key: str = field(default_factory=cgroups.home_key)  # the state directory's, in the job's mark

    def looks_beyond_cgroup(self) -> bool:
        return self.cgroup is None or self.thorough

    def tree(self) -> list[int]:
        """The processes below the root, but for those with another mark and all below them:
        a daemon started from inside the job (its `submit` autostarts one, marked empty) is a
        descendant of the job's subreaper, and so are that daemon's supervisors and their jobs."""
        if not self.root or not procs.is_alive(self.root, self.root_ticks):
            return []
        mark = proctrack.job_mark(self.key, self.job_id)
        below = procs.descendants(self.root, prune=lambda pid: procs.job_mark(pid) not in (None, mark))
        return [self.root, *below] if self.root_is_job else below

    def found(self) -> list[int]:
        """Live processes of the job found outside its cgroup: its tree and its mark."""
        if not self.looks_beyond_cgroup():
            return []
        pids = {*self.tree(), *procs.marked(self.key).get(self.job_id, [])}
        return [p for p in pids if procs.is_alive(p, None)]

    def left(self) -> list[int]:
        """`found()`, and the job's process group id while a process of the group lives."""
        group = self.looks_beyond_cgroup() and procs.group_alive(self.pgid)
        return self.found() + ([self.pgid] if group else [])

    def populated(self) -> bool | None:
        """Whether a process is in the job's cgroup; None without a cgroup."""
        return cgroups.populated(self.cgroup) if self.cgroup is not None else None

    def gone(self) -> bool:
        return proctrack.all_gone(self.populated(), self.left())

    def signal(self, sig: int) -> None:
        """`sig` to every process of the job; SIGKILL through the cgroup's cgroup.kill."""
        if self.cgroup is not None and sig == signal.SIGKILL:
            cgroups.kill(self.cgroup)
        elif self.cgroup is not None:
            cgroups.signal_all(self.cgroup, sig)
        if self.looks_beyond_cgroup():
            procs.signal_group(self.pgid, sig)
            procs.signal_pids(self.found(), sig)

    def wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.gone():
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_STEP_S)
        return True

    def end(self, grace_s: float | None) -> None:
        """End them all and wait until none is left: SIGTERM and up to `grace_s` first (None:
        straight to SIGKILL), then SIGKILL again and again. A job ends only when its last process
        has: a process that SIGKILL cannot end yet (in uninterruptible sleep) is waited for."""
        if grace_s is not None:
            self.signal(signal.SIGTERM)
            if self.wait_gone(grace_s):
                return
        started = time.monotonic()
        warned = started
        while True:
            self.signal(signal.SIGKILL)
            if self.wait_gone(1.0):
                return
            if time.monotonic() - warned >= 30:
                warned = time.monotonic()
                log.warning("job %d: processes still alive %.0f s after SIGKILL", self.job_id, warned - started)

    def remove(self) -> bool:
        """Remove the job's cgroup once it is empty; True when it is gone (or there was none)."""
        return self.cgroup is None or cgroups.remove(self.cgroup)

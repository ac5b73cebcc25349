"""The cgroup v2 file I/O of job tracking: create a job's cgroup, enter it, read, kill, remove.

Each state directory has one parent cgroup, `<cgroup2 mount>/sae-dist-<state key>` (the key:
`proctrack.state_key` of its resolved path), with one child per running job, `job-<id>`. The
parent sits at the top of the cgroup2 hierarchy, not under the daemon's own cgroup: every
daemon and supervisor of the state directory finds it, wherever it was started (a daemon
started from inside a job included). No controller is enabled, so processes may live beside the
child cgroups; the cgroups only hold processes together. Which tracking a job gets, and when its
processes are gone, is decided in `scheduler.proctrack`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

from sae_dist.paths import state_home
from scheduler import proctrack


@functools.lru_cache(maxsize=1)
def mount() -> Path | None:
    """The cgroup2 mount point, from /proc/self/mounts; None without one (or without /proc)."""
    try:
        found = proctrack.cgroup2_mount(Path("/proc/self/mounts").read_text())
    except OSError:
        return None
    return Path(found) if found else None


def home_key() -> str:
    return proctrack.state_key(str(state_home().resolve()))


def parent() -> Path | None:
    """This state directory's parent cgroup (it may not exist yet); None without a cgroup2 mount."""
    root = mount()
    return root / proctrack.parent_name(home_key()) if root else None


def job_path(job_id: int) -> Path | None:
    """Where a job's cgroup is (it may not exist); None without a cgroup2 mount."""
    top = parent()
    return top / proctrack.job_name(job_id) if top else None


def why_not() -> str | None:
    """Why jobs cannot have cgroups here, or None when one may be tried."""
    return proctrack.why_not_cgroups(os.environ.get(proctrack.CGROUPS_ENV), os.geteuid(), _mount_text())


def _mount_text() -> str | None:
    root = mount()
    return str(root) if root else None


def create(job_id: int) -> tuple[Path | None, str | None]:
    """The job's cgroup, made (and emptied, should a process of an earlier run of the job id be
    in it) and checked writable: (path, None), or (None, why not) for the fallback."""
    why = why_not()
    if why is not None:
        return None, why
    path = job_path(job_id)
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
    except OSError as e:
        return None, f"cannot create {path}: {e.strerror or e}"
    if populated(path):
        kill(path)
        wait_empty(path, 10.0)
    return path, None


def entry(path: Path) -> int:
    """An open descriptor of the cgroup's cgroup.procs: a child that writes "0" to it (in a
    `preexec_fn`, before it runs anything of the job) moves itself into the cgroup."""
    return os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)


def procs(path: Path) -> list[int]:
    """Every process in the cgroup and in any cgroup the job made below it."""
    found = []
    for folder, _, _ in os.walk(path):
        try:
            found += [int(p) for p in Path(folder, "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def populated(path: Path) -> bool:
    """Whether any process (zombies do not count) is in the cgroup or below it; a cgroup that
    is gone holds none."""
    try:
        return proctrack.populated(Path(path, "cgroup.events").read_text())
    except OSError:
        return False


def kill(path: Path) -> None:
    """SIGKILL every process in the cgroup and below it: `cgroup.kill` (Linux 5.14+, race-free:
    a process forking meanwhile cannot slip out), else each process in cgroup.procs."""
    try:
        Path(path, "cgroup.kill").write_text("1")
        return
    except FileNotFoundError:
        if not Path(path).is_dir():
            return  # the cgroup is gone, with its processes
    except OSError:
        pass
    signal_all(path, signal.SIGKILL)


def signal_all(path: Path, sig: int) -> None:
    for pid in procs(path):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_empty(path: Path, timeout: float) -> bool:
    """Wait until the cgroup holds no process; True when it emptied within timeout."""
    deadline = time.monotonic() + timeout
    while populated(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def remove(path: Path) -> bool:
    """Remove an empty cgroup and any the job made below it; True when it is gone (False while
    a process is still in it)."""
    for folder, _, _ in os.walk(path, topdown=False):
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return False
    return True


def job_cgroups() -> list[str]:
    """The names of the job cgroups under this state directory's parent."""
    top = parent()
    try:
        return sorted(os.listdir(top)) if top else []
    except OSError:
        return []


def cgroup_of(pid: int | str) -> str | None:
    """A process's cgroup v2 path ("/sae-dist-k/job-3"), None when it is gone or has none."""
    try:
        return proctrack.own_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None


def leave_job_cgroup() -> str | None:
    """In a daemon started from inside a job (a job's `submit` autostarts one): move out of that
    job's cgroup into this state directory's parent, so the job's end does not end the daemon
    and every supervisor it forks. Returns the cgroup it left, None when it was in none."""
    own = cgroup_of("self")
    top = parent()
    if why_not() is not None or top is None or not proctrack.in_a_job_cgroup(own):
        return None
    try:
        top.mkdir(exist_ok=True)
        Path(top, "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return own


def remove_home(home: Path, timeout: float = 10.0) -> bool:
    """Kill every job of a state directory and remove its cgroups (tests, at their end); True
    when none is left."""
    root = mount()
    top = root / proctrack.parent_name(proctrack.state_key(str(home.resolve()))) if root else None
    if top is None or not top.is_dir():
        return True
    kill(top)
    wait_empty(top, timeout)
    return remove(top)

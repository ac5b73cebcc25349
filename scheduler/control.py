"""Talking to the daemon from outside it: is it running, wake it, start it, stop it.

One daemon runs per state directory; it holds `daemon.lock` for its whole life and writes its
pid (with the process's start time, so a reused pid is not mistaken for it) to `daemon.pid`.
Clients (the CLI, `scheduler.actions`, `scheduler.submit`, the supervisors, the app) only need
this module, never the daemon loop in `scheduler.daemon`, so none of them imports the loop's
database and device machinery, and the daemon and the supervisor it forks do not import each
other.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sae_dist.contract import JOB_MARK_ENV
from sae_dist.errors import UserError
from sae_dist.paths import state_home
from scheduler import procs

if TYPE_CHECKING:
    from filelock import FileLock

AUTOSTART_ENV_VAR = "SAE_DIST_AUTOSTART"


def daemon_lock_path() -> Path:
    return state_home() / "daemon.lock"


def pid_file() -> Path:
    return state_home() / "daemon.pid"


def take_daemon_lock(dead_holder_wait_s: float = 5.0) -> FileLock:
    """The lock only the running daemon holds; a UserError when another daemon has it.

    A daemon SIGKILLed just as it forked a supervisor leaves its lock with that child for the
    few milliseconds until the child closes it: while the recorded daemon is dead, we wait."""
    from filelock import FileLock, Timeout  # here: clients never take it, and filelock costs them time

    lock = FileLock(str(daemon_lock_path()))
    deadline = time.monotonic() + dead_holder_wait_s
    while True:
        try:
            lock.acquire(timeout=0)
            return lock
        except Timeout:
            pid, ticks = _recorded_daemon()
            if procs.is_alive(pid, ticks) or time.monotonic() > deadline:
                raise UserError(f"a scheduler daemon already runs for {state_home()} (see {pid_file()})") from None
            time.sleep(0.01)


def lock_file_identity() -> tuple[int, int] | None:
    """The daemon lock file's (device, inode), or None when it is gone. A daemon compares it with
    the one it took: a state home removed (or removed and made again) under a running daemon no
    longer has its lock, and a second daemon may already hold the new one."""
    try:
        found = os.stat(daemon_lock_path())
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def write_pid_file() -> int:
    """Record this process as the daemon (pid and start time). Returns the pid. Written whole
    and renamed into place, so a reader never sees a half-written file."""
    me = os.getpid()
    partial = pid_file().with_suffix(".pid.partial")
    partial.write_text(f"{me} {procs.start_ticks(me)}\n")
    os.replace(partial, pid_file())
    return me


def _recorded_daemon() -> tuple[int, int] | tuple[None, None]:
    """(pid, start ticks) from the pid file, or (None, None) when there is none to read."""
    try:
        pid, ticks = (int(x) for x in pid_file().read_text().split())
    except (OSError, ValueError):
        return None, None
    return pid, ticks


def daemon_running() -> bool:
    """True while some process holds the daemon lock. FileLock is flock(2) on the file, probed
    here with fcntl directly: importing filelock would cost every `submit` ~20 ms. A read-only
    descriptor is enough to probe, and no file means no daemon ever ran here."""
    try:
        fd = os.open(daemon_lock_path(), os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # releases our probe's lock, if it got it
    return False


def wake_daemon() -> None:
    """Ask the daemon for a scheduling pass now (SIGUSR1); harmless when none runs."""
    pid, ticks = _recorded_daemon()
    if pid is not None and procs.is_alive(pid, ticks):
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass


def start_daemon_detached(wait: bool = True, timeout_s: float = 30.0) -> bool:
    """Start a daemon in the background. With `wait`, return once it holds the lock: True, or
    False when another daemon got there first (two `daemon --detach` at once: one starts, the
    other says a daemon runs); a UserError when it died at start. Without, return True at once
    (after a submit: a daemon that loses the race just exits)."""
    import subprocess

    log_path = state_home() / "daemon.log"
    with open(log_path, "ab") as out:
        # Started from inside a job (its script submits), it is not one of the job's processes:
        # its mark is empty (see scheduler.tracking), and it leaves the job's cgroup at start.
        env = {**os.environ, JOB_MARK_ENV: ""}
        proc = subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True, cwd=str(state_home()), env=env)
    deadline = time.monotonic() + timeout_s
    while wait and time.monotonic() < deadline:
        if _recorded_daemon()[0] == proc.pid and daemon_running():
            return True
        if proc.poll() is not None:
            if daemon_running():
                return False
            raise UserError(f"the daemon exited with code {proc.returncode} at start (see {log_path})")
        time.sleep(0.02)
    if wait:
        raise UserError(f"the daemon did not start within {timeout_s:.0f} s (see {log_path})")
    return True


def stop_daemon(timeout_s: float = 15.0) -> int | None:
    """SIGTERM the daemon and wait for it to let go of its lock. Returns its pid, None if none ran.
    Its jobs carry on (their supervisors do not depend on it)."""
    pid, ticks = _recorded_daemon()
    if pid is None or not procs.is_alive(pid, ticks) or not daemon_running():
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while daemon_running():
        if time.monotonic() > deadline:
            raise UserError(f"the daemon {pid} did not stop within {timeout_s:.0f} s")
        time.sleep(0.05)
    return pid


def ensure_daemon() -> bool:
    """After a submit: start a daemon when none runs, else wake it, so a newcomer never has to.

    `SAE_DIST_AUTOSTART=0` (tests, a machine where the daemon is a service) starts none and only
    wakes one that runs. Shared by the CLI and the app. Returns True when it started one.
    """
    if os.environ.get(AUTOSTART_ENV_VAR, "1") != "0" and not daemon_running():
        start_daemon_detached(wait=False)
        return True
    wake_daemon()
    return False

"""What the GPU check's steps share: a state home of their own, the real scheduler daemon and CLI
run as processes (as a user runs them), and waiting for a job's state in the database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


class CheckFailed(Exception):
    """A check of a step did not hold: its message is the step's last line."""


def expect(condition, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def use_home(home: Path, virtual: int | None) -> None:
    """This process and every process it starts use `home` as the state home (and `virtual`
    CPU-backed devices instead of the driver's GPUs, when given)."""
    home.mkdir(parents=True, exist_ok=True)
    os.environ["SAE_DIST_HOME"] = str(home)
    os.environ.pop("SAE_DIST_DB_URL", None)
    if virtual is None:
        os.environ.pop("SAE_DIST_VIRTUAL_GPUS", None)
    else:
        os.environ["SAE_DIST_VIRTUAL_GPUS"] = str(virtual)


def home_args(virtual_help: str) -> tuple[Path, bool]:
    """A step's arguments, HOME and --virtual (the rehearsal's CPU-backed device), with HOME made
    this process's state home: (home, virtual)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("home", type=Path)
    p.add_argument("--virtual", action="store_true", help=virtual_help)
    ns = p.parse_args()
    use_home(ns.home, 1 if ns.virtual else None)
    return ns.home, ns.virtual


def cli(*args: str, module: str = "scheduler", timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise CheckFailed(f"`{module} {' '.join(args)}` exited {out.returncode}: {out.stderr.strip()[-300:]}")
    return out


def cli_json(command: str, *args: str, module: str = "scheduler", timeout: float = 120):
    """The command's --json answer (the flag goes first: a command job's argv follows `--`)."""
    return json.loads(cli(command, "--json", *args, module=module, timeout=timeout).stdout)


def submit(*args: str) -> int:
    return int(cli_json("submit", *args)["job_id"])


class Daemon:
    """The real scheduler daemon for this home, in a session of its own; stopped on exit."""

    def __init__(self, home: Path):
        self.log = home / "daemon.log"

    def __enter__(self) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], cwd=REPO, stdout=log,
                                         stderr=log, start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_for(predicate, timeout: float, what: str, every: float = 0.2):
    """predicate()'s first truthy value; CheckFailed naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def job(job_id: int):
    from sae_dist.db import get_engine
    from scheduler.store import get_job

    return get_job(get_engine(), job_id)


def wait_ended(job_id: int, timeout: float):
    """The job once it ended; CheckFailed saying where it stood and what `info` shows, if not in time."""
    try:
        return wait_for(lambda: (j := job(job_id)).state not in ("PENDING", "RUNNING") and j, timeout,
                        f"job {job_id} to end", every=0.5)
    except CheckFailed as e:
        stuck = job(job_id)
        devices = "; ".join(f"{r['uuid']}: {r['state']} ({r['reason']})" for r in cli_json("info"))
        raise CheckFailed(f"{e}: it is {stuck.state} ({stuck.reason}); devices: {devices}") from None


def run_step(main) -> None:
    """Run a step's main(): its CheckFailed is its last line and exit code 1."""
    try:
        code = main()
    except CheckFailed as e:
        print(f"FAILED: {e}", flush=True)
        code = 1
    sys.exit(code)

"""Preemption benchmark: how long an urgent job waits for a preemptible job's device (a script
that prints what it measured in one run, not a timed test).

    .venv/bin/python scripts/bench_preemption.py [--grace 5] [--runs 3]

On one virtual device in a throwaway state home, with a daemon running: a preemptible job
runs, then a job of higher priority is submitted, and the wait is the urgent job's
`started_at - submitted_at` from the database. Two victims:
- one that stops at SIGTERM (a training checkpointing at its next report does the same), and
- one that ignores SIGTERM, so it is SIGKILLed when its grace time runs out: the worst case.
The goal: the urgent job has the device within the grace time plus 5 s (printed as a ratio of
the bound, median of --runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BOUND_EXTRA_S = 5.0
VICTIMS = {
    "stops at SIGTERM": "import time; time.sleep(600)",
    "ignores SIGTERM": "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
}


def cli(env: dict[str, str], *args: str) -> str:
    return subprocess.run([PY, "-m", "scheduler", *args], cwd=REPO, env=env, check=True,
                          capture_output=True, text=True).stdout


def wait_state(job_id: int, state: str, timeout: float = 300):
    """The job's row once it is in `state` (read in this process: microsecond timestamps)."""
    from sae_dist.db import get_engine
    from scheduler.store import get_job

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_job(get_engine(), job_id)
        if job.state == state:
            return job
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} did not reach {state} in {timeout:.0f} s")


def one_wait(env: dict[str, str], victim_code: str, grace: float) -> float:
    """Seconds from the urgent job's submit to its start (the database's own timestamps)."""
    victim = json.loads(cli(env, "submit", "--json", "--preemptible", "--grace-time", str(grace), "--gpus", "1",
                            "--", PY, "-c", victim_code))["job_id"]
    wait_state(victim, "RUNNING")
    time.sleep(1.0)  # the victim's Python is up and has its handler
    urgent = json.loads(cli(env, "submit", "--json", "--priority", "10", "--gpus", "1", "--", "true"))["job_id"]
    job = wait_state(urgent, "COMPLETED", timeout=grace + 120)
    cli(env, "cancel", str(victim))  # requeued by the preemption: gone before the next run
    return (job.started_at - job.submitted_at).total_seconds()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grace", type=float, default=5.0, help="the victims' --grace-time (s)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sae-dist-bench-preempt-") as home:
        os.environ.update(SAE_DIST_HOME=home, SAE_DIST_VIRTUAL_GPUS="1", SAE_DIST_AUTOSTART="0")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        daemon = subprocess.Popen([PY, "-m", "scheduler", "daemon"], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            bound = args.grace + BOUND_EXTRA_S
            print(f"grace time {args.grace:g} s; bound {bound:g} s (grace + {BOUND_EXTRA_S:g} s); "
                  f"median of {args.runs}; load average {os.getloadavg()[0]:.1f}")
            for label, code in VICTIMS.items():
                waits = [one_wait(env, code, args.grace) for _ in range(args.runs)]
                med = statistics.median(waits)
                print(f"victim {label:17s}: urgent job started after {med:5.2f} s "
                      f"(runs {', '.join(f'{w:.2f}' for w in waits)}); {med / bound:.2f} of the bound"
                      f" -> {'met' if med <= bound else 'NOT met'}")
        finally:
            daemon.terminate()
            daemon.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

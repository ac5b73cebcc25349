"""How long a queued training sits before its first step, with two checkouts on one machine.

    .venv/bin/python scripts/bench_job_start.py [--rounds 2] [--devices 2]

The compiled top-k kernel lives in torch's extension cache, which is per user, not per checkout.
Under one name, two checkouts (or one before and after an update) rebuilt it in turn at some
job's start, behind torch's build lock: 40 s to minutes at "step 0". Built under a name of its
source and torch's version, each source is built once (at set-up) and every checkout with it
loads that build. This script clones this checkout into a temporary folder (a second checkout),
then, alternating between the two, queues the same small training through a daemon of each
checkout's own and prints, for each, the seconds from the job's start (the scheduler's
`started_at`) to its run's first logged step, and the kernel build each loaded.
Goal (issue 32): at most 10 s on the 2-core machine, with the kernel built at set-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = """
d_in = 64
d_sae = 512
k = 8
batch_size = 256
steps = 40
log_every = 1
checkpoint_every = 0
eval_rows = 0
"""
FIRST_STEP = """
import sys
from sqlmodel import Session, select
from sae_dist.db import StepMetric, TrainingRun, get_engine
from scheduler.store import get_job
engine = get_engine()
job = get_job(engine, int(sys.argv[1]))
with Session(engine) as s:
    run = s.exec(select(TrainingRun).where(TrainingRun.job_id == job.id)).first()
    first = run and s.exec(select(StepMetric).where(StepMetric.run_id == run.id).order_by(StepMetric.step)).first()
print(job.state, job.started_at.timestamp() if job.started_at else "", first.time.timestamp() if first else "")
"""


def python(checkout: Path, *args: str, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def one_job(checkout: Path, home: Path, devices: int) -> tuple[float, str]:
    """(seconds from the job's start to its first logged step, the kernel build it loads)."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {**os.environ, "SAE_DIST_HOME": str(home), "SAE_DIST_VIRTUAL_GPUS": str(devices),
           "SAE_DIST_AUTOSTART": "0", "PYTHONPATH": str(checkout)}
    env.pop("SAE_DIST_DB_URL", None)
    (home / "run.toml").write_text(textwrap.dedent(RUN) + f'out_dir = "{home / "run"}"\n')
    kernel = python(checkout, "-c", "from sae_dist.models.kernels import module_name; print(module_name('topk_cpu'))",
                    env=env)
    with open(home / "daemon.log", "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], cwd=checkout, env=env,
                                  stdout=log, stderr=log, start_new_session=True)
    job_id = None
    try:
        job_id = python(checkout, "-m", "scheduler", "submit", "--gpus", str(devices), "--train",
                        str(home / "run.toml"), env=env).split()[-1]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            state, started, first = (python(checkout, "-c", FIRST_STEP, job_id, env=env).split() + ["", ""])[:3]
            if first:
                return float(first) - float(started), kernel
            if state not in ("PENDING", "RUNNING"):
                raise SystemExit(f"{checkout}: the job ended {state} before its first step; see {home}")
            time.sleep(0.2)
        raise SystemExit(f"{checkout}: no first step within 300 s; see {home}")
    finally:
        # The job ends before the next starts: its ranks would load the machine the next one is timed on.
        if job_id is not None:
            subprocess.run([sys.executable, "-m", "scheduler", "cancel", job_id], cwd=checkout, env=env,
                           capture_output=True, timeout=60)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and python(checkout, "-c", FIRST_STEP, job_id, env=env).split()[0] \
                    in ("PENDING", "RUNNING"):
                time.sleep(0.2)
        daemon.terminate()
        daemon.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="jobs per checkout, alternating (default 2)")
    p.add_argument("--devices", type=int, default=2, help="virtual devices (ranks) of each job (default 2)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-job-start-", ignore_cleanup_errors=True) as tmp:
        second = Path(tmp) / "second-checkout"
        subprocess.run(["git", "clone", "-q", str(REPO), str(second)], check=True)
        times: dict[str, list[float]] = {"this checkout": [], "a second checkout": []}
        for r in range(ns.rounds):
            for label, checkout in (("this checkout", REPO), ("a second checkout", second)):
                took, kernel = one_job(checkout, Path(tmp) / f"home-{r}-{label[0]}", ns.devices)
                times[label].append(took)
                print(f"round {r + 1}, {label}: first step {took:.1f} s after the job started "
                      f"(kernel {kernel})", flush=True)
    everything = [t for ts in times.values() for t in ts]
    print(f"job start to first logged step, {ns.devices} ranks: median {statistics.median(everything):.1f} s, "
          f"slowest {max(everything):.1f} s over {len(everything)} jobs (goal: at most 10 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

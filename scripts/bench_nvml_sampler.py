"""The daemon's device sampling on an emulated 8-GPU machine: prints figures measured in one run
(a script, not a timed test).

    .venv/bin/python scripts/bench_nvml_sampler.py [--window 30] [--devices 8] [--real]

Starts a real scheduler daemon (no job) in a throwaway state home, once on `--devices` A100s
emulated by tests/fake_nvml (the real nvidia-ml-py, the product's NVML reads, one pass and one
sample of every device a second) and once on as many virtual devices, and measures each
daemon's CPU time over `--window` seconds (from /proc/PID/stat, after a warm-up), as a share of
one core. Goal (issue 19): under 1% of a core for 8 GPUs at 1 Hz. Also the cost of one
inventory read in a process of its own (median of 200).

What this cannot measure: a real driver's cost per call (each is an ioctl into the kernel
module; the emulated one answers from memory), so the NVML share on a GPU machine is higher by
what its driver takes; `--real` (run by scripts/gpu_check.sh) measures it there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the emulated driver lives with the tests

import fake_nvml  # noqa: E402

READ_COST = """
import statistics, time
from scheduler.devices import inventory
inventory()
cpu = []
for _ in range(200):
    t = time.process_time(); inventory(); cpu.append(time.process_time() - t)
devices = inventory()
print(len(devices), sum(d.virtual for d in devices), statistics.median(cpu))
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_share(env: dict[str, str], window_s: float, warmup_s: float) -> tuple[float, int]:
    """(% of one core, samples written) of an idle daemon over `window_s`."""
    home = Path(env["SAE_DIST_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "daemon.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], cwd=REPO, env=env,
                                stdout=log, stderr=log, start_new_session=True)
    try:
        time.sleep(warmup_s)  # start-up: imports, migrations, the first passes
        before, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(window_s)
        used, elapsed = cpu_seconds(proc.pid) - before, time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(30)
    import sqlite3

    with sqlite3.connect(home / "state.db") as db:
        samples = db.execute("SELECT count(*) FROM gpu_samples").fetchone()[0]
    return 100.0 * used / elapsed, samples


def read_cost(env: dict[str, str]) -> tuple[int, int, float]:
    out = subprocess.run([sys.executable, "-c", READ_COST], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True)
    n, virtual, cpu = out.stdout.split()
    return int(n), int(virtual), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=30.0, help="seconds over which CPU is measured")
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--real", action="store_true",
                    help="this machine's NVIDIA driver instead of the emulated one (a GPU machine)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-nvml-") as tmp:
        tmp = Path(tmp)
        # The repository first, and whatever the caller put on the path after it (a GPU machine's
        # carried wheels).
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        base = {**os.environ, "PYTHONPATH": path, "SAE_DIST_AUTOSTART": "0"}
        base.pop("SAE_DIST_DB_URL", None)
        if args.real:  # the driver's GPUs; the emulated one is not built (no nvml.h there)
            emulated = {k: v for k, v in base.items() if k != "SAE_DIST_VIRTUAL_GPUS"}
            emulated["SAE_DIST_HOME"] = str(tmp / "nvml")
        else:
            lib = fake_nvml.build(tmp / "lib")
            machine = {"devices": [fake_nvml.a100(0x07 + i, i) for i in range(args.devices)]}
            scenario = fake_nvml.write(tmp / "scenario.json", machine)
            emulated = fake_nvml.environment(lib, scenario, {**base, "SAE_DIST_HOME": str(tmp / "nvml")})
        virtual = {**base, "SAE_DIST_HOME": str(tmp / "virtual"), "SAE_DIST_VIRTUAL_GPUS": str(args.devices)}

        kind = "real" if args.real else "emulated"
        n, nv, cpu = read_cost(emulated)
        if args.real:
            args.devices = n
        assert n == args.devices and nv == 0, f"expected {args.devices} {kind} GPUs, read {n} ({nv} virtual)"
        print(f"one inventory read of {n} {kind} GPUs (NVML, in-process): {cpu * 1e3:.2f} ms CPU (median of 200)")
        n, nv, cpu = read_cost(virtual)
        print(f"one inventory read of {n} virtual devices (/proc):          {cpu * 1e3:.2f} ms CPU (median of 200)")
        print("goal: under 1% of a core for 8 GPUs at 1 Hz." + ("" if args.real else " A real driver's per-call "
              "cost is not emulated: --real (scripts/gpu_check.sh) measures it on a GPU machine."))
        # the GPUs' figure last: it is the summary a caller reads
        for label, env in ((f"{args.devices} virtual devices", virtual),
                           (f"{args.devices} {kind} GPUs (NVML)", emulated)):
            share, samples = daemon_share(env, args.window, args.warmup)
            print(f"idle daemon sampling {label} at 1 Hz: {share:.2f}% of one core over {args.window:g} s "
                  f"({samples} samples written)")


if __name__ == "__main__":
    main()

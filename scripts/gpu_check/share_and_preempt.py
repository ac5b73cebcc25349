"""Jobs sharing the GPU by memory, and a preemptible job giving it up, on the real driver.

    python3 scripts/gpu_check/share_and_preempt.py HOME            # the GPU
    python3 scripts/gpu_check/share_and_preempt.py HOME --virtual  # the rehearsal: one CPU-backed device

Sharing: two `--shared --mem` jobs, each holding memory on the device, run at once; `info` names
both as its sharers, with what each uses measured per process (NVML's per-process memory on a
GPU, resident memory on a virtual device), and the one holding more than it declared as OVER.
Preemption: a `--preemptible` job holding the device is stopped when a job of higher priority is
queued; that job runs, and the victim is requeued, runs again and completes. Both say how the
scheduler held each job's processes together (a cgroup of its own, or why not).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harness import Daemon, cli_json, expect, home_args, job, run_step, submit, wait_ended, wait_for

MIB = 2**20

# A job that holds `mib` MiB where its device is (the GPU, or host memory on a virtual device) until
# the file `release` exists; with `once`, a second run (after a requeue) holds nothing and ends.
HOLDER = """
import os, sys, time
mib, release, once, cuda = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "cuda"
if once != "-" and os.path.exists(once):
    print("second run: done", flush=True); sys.exit(0)
if once != "-":
    open(once, "w").close()
if cuda:
    import torch
    held = torch.ones(mib * 2**20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
else:
    held = bytearray(b"x" * (mib * 2**20))
print("holding", mib, "MiB", flush=True)
while not os.path.exists(release):
    time.sleep(0.1)
"""

# (declared --mem, MiB held) of the two sharers on a GPU and on a virtual device: the second holds
# more than it declared. On a GPU a process also holds its CUDA context (about 750 MiB on an H200),
# which NVML counts as its own.
SHARERS = {"gpu": ((4096, 1024), (1024, 2048)), "virtual": ((512, 32), (64, 256))}


def holder(home: Path, mib: int, release: Path, cuda: bool, once: Path | None = None) -> list[str]:
    script = home / "holder.py"
    script.write_text(HOLDER)
    return ["--", sys.executable, str(script), str(mib), str(release), str(once or "-"), "cuda" if cuda else "cpu"]


def tracking_of(job_id: int) -> str:
    """How the job's processes are held, once it runs: its process's cgroup, or that it has none
    of its own."""
    from scheduler import cgroups

    running = wait_for(lambda: (j := job(job_id)).pid and j, 60, f"job {job_id} to run (its pid)")
    why = cgroups.why_not()
    return f"cgroup {cgroups.cgroup_of(running.pid)}" if why is None else f"no cgroup ({why})"


def check_sharing(home: Path, cuda: bool) -> str:
    (fit_mem, fit_hold), (over_mem, over_hold) = SHARERS["gpu" if cuda else "virtual"]
    release = home / "release-shared"
    fits = submit("--gpus", "1", "--shared", "--mem", f"{fit_mem}M", "-J", "fits",
                  *holder(home, fit_hold, release, cuda))
    over = submit("--gpus", "1", "--shared", "--mem", f"{over_mem}M", "-J", "over",
                  *holder(home, over_hold, release, cuda))
    both = wait_for(lambda: all(job(i).state == "RUNNING" for i in (fits, over)), 60,
                    f"shared jobs {fits} and {over} to run together")
    expect(both and json.loads(job(fits).devices_json) == json.loads(job(over).devices_json),
           "the two shared jobs run on different devices")
    tracking = tracking_of(fits)

    def sharers_seen():
        row = cli_json("info")[0]
        seen = {s["job"]: s for s in row.get("sharers") or []}
        return row if set(seen) == {fits, over} and seen[over]["over"] and seen[fits]["used"] else None

    row = wait_for(sharers_seen, 45, f"info to name jobs {fits} and {over} as sharers, {over} OVER its --mem")
    seen = {s["job"]: s for s in row["sharers"]}
    expect(not seen[fits]["over"], f"job {fits} uses {seen[fits]['used'] / MIB:.0f} MiB, declared {fit_mem} MiB, "
                                   "yet is called OVER")
    print("info's sharers:", "; ".join(f"job {s['job']}: uses {s['used'] / MIB:.0f} MiB, declared "
                                       f"{s['declared'] / MIB:.0f} MiB{', OVER' if s['over'] else ''}"
                                       for s in row["sharers"]))
    release.touch()
    for i in (fits, over):
        expect(wait_ended(i, 60).state == "COMPLETED", f"shared job {i} ended {job(i).state}")
    return (f"2 shared jobs ran together; measured {seen[fits]['used'] / MIB:.0f} MiB (declared {fit_mem}) and "
            f"{seen[over]['used'] / MIB:.0f} MiB (declared {over_mem}: named OVER); {tracking}")


def check_preemption(home: Path, cuda: bool) -> str:
    release = home / "release-victim"
    victim = submit("--gpus", "1", "--preemptible", "--grace-time", "5", "-J", "victim",
                    *holder(home, 256, release, cuda, once=home / "victim-ran"))
    tracking = tracking_of(victim)  # once it runs
    asked = time.monotonic()
    urgent = submit("--gpus", "1", "--priority", "10", "-J", "urgent", "--", sys.executable, "-c", "pass")
    wait_for(lambda: job(urgent).state in ("RUNNING", "COMPLETED"), 60, f"urgent job {urgent} to start")
    took = time.monotonic() - asked
    expect(wait_ended(urgent, 60).state == "COMPLETED", f"the urgent job ended {job(urgent).state}")
    again = wait_ended(victim, 90)
    expect(again.state == "COMPLETED", f"the victim ended {again.state} after its requeue")
    attempts = json.loads(again.attempts_json or "[]")
    expect([a.get("state") for a in attempts] == ["PREEMPTED"], f"the victim's earlier runs: {attempts}")
    return (f"victim {victim} PREEMPTED: urgent job {urgent} had the device {took:.1f} s after it was queued "
            f"(grace 5 s); the victim was requeued and completed; {tracking}")


def main() -> int:
    home, virtual = home_args("one CPU-backed device (rehearsal)")
    expect(cli_json("info")[0]["virtual"] == virtual,
           "NVML shows no GPU here (virtual devices)" if not virtual else "a real GPU where a virtual one was asked")
    with Daemon(home):
        shared = check_sharing(home, cuda=not virtual)
        print(shared, flush=True)
        preempted = check_preemption(home, cuda=not virtual)
        print(preempted, flush=True)
    print(f"{shared}. {preempted}")
    return 0


if __name__ == "__main__":
    run_step(main)

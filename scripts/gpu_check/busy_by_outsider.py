"""A process outside the scheduler allocating on the GPU makes it busy for the scheduler, and it
is free again when that process ends (on the real driver; the emulated one's tests cover the rest).

    python3 scripts/gpu_check/busy_by_outsider.py HOME

`info` names the stranger's pid; a job queued meanwhile waits (PENDING) and runs once it is gone.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from harness import Daemon, cli_json, expect, job, run_step, submit, use_home, wait_ended, wait_for

STRANGER = ("import sys, time, torch\n"
            "x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
            "print('allocated', flush=True); time.sleep(600)")


def gpu_row() -> dict:
    return cli_json("info")[0]


def main() -> int:
    home = Path(sys.argv[1])
    use_home(home, None)
    expect(not gpu_row()["virtual"], "NVML shows no GPU here (virtual devices)")
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER], stdout=subprocess.PIPE, text=True)
    try:
        expect(stranger.stdout.readline().strip() == "allocated", "the stranger could not allocate on the GPU")
        busy = wait_for(lambda: (r := gpu_row())["state"] == "busy" and r, 30, "info to show the GPU busy")
        print(f"with a stranger (pid {stranger.pid}) holding 1 GiB: {busy['state']}, {busy['reason']}")
        expect(busy["reason"] == f"used by pid {stranger.pid}, not a scheduler job",
               f"the reason names another process: {busy['reason']!r} (the stranger is pid {stranger.pid})")
        with Daemon(home):
            queued = submit("--gpus", "1", "-J", "after-stranger", "--", "true")
            time.sleep(5)  # several scheduling passes
            waiting = job(queued)
            print(f"job {queued} queued meanwhile: {waiting.state} ({waiting.reason})")
            expect(waiting.state == "PENDING", f"job {queued} was {waiting.state} on a GPU a stranger holds")
            stranger.kill()
            stranger.wait()
            ended = wait_ended(queued, 60)
            expect(ended.state == "COMPLETED", f"job {queued} ended {ended.state} after the stranger left")
        free = gpu_row()
        expect(free["state"] == "idle", f"after the stranger and the job: {free['state']} ({free['reason']})")
    finally:
        stranger.kill()
    print(f"a stranger's 1 GiB made the GPU busy (named its pid); job {queued} waited, then ran when it left; "
          f"the GPU is idle again")
    return 0


if __name__ == "__main__":
    run_step(main)

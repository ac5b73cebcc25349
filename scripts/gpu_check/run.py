"""The GPU check's steps, each in a process of its own under its own time limit, within one
budget for the whole check; writes the verdict (markdown and JSON) and one archive of the logs.

    python3 scripts/gpu_check/run.py --out DIR [--rehearse] [--budget 420]

Started by scripts/gpu_check.sh, which sets up the Python path first. A step passes on exit 0,
says SKIP (with why) on exit 3, fails otherwise, and is TIMEOUT past its limit (its whole process
group is killed). A step that needs CUDA or the real driver is SKIP in the rehearsal, saying so,
and a step that would start with too little of the budget left is SKIP too: one hang cannot
spend the lease. This process never touches CUDA itself (it would hold the GPU beside the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from verdict import Row, detail_of, exit_code, markdown, to_json, verdict_of

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
MIN_STEP_S = 20  # a step is not started with less of the budget left than this
GPU_SHAPES = "768x24576x32,4096x65536x64"
LOG_SUFFIXES = (".log", ".out", ".txt", ".json", ".toml", ".md")


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str] | None  # on the GPU machine; None: it cannot run there, saying `why`
    timeout_s: int
    rehearse: list[str] | None  # on a machine without CUDA; None: left for the GPU, saying `why`
    why: str = "needs CUDA"


def steps(work: Path, gpus: int) -> list[Step]:
    def script(name: str, *args: str) -> list[str]:
        return [PY, str(HERE / name), *args]

    bench = [PY, "scripts/bench_step.py", "--device", "cuda", "--sparsify", "--shapes", GPU_SHAPES]
    bench_cpu = [PY, "scripts/bench_step.py", "--device", "cpu", "--sparsify", "--shapes", "64x512x8",
                 "--steps", "3", "--rounds", "1", "--threads", "1"]
    two_gpus = [PY, "-m", "sae_dist", "bench", "--devices", "1,2", "--device-kind", "cuda", "--no-queue",
                "--steps", "20", "--repeats", "2", "--d-in", "768", "--d-sae", "24576", "--k", "32",
                "--batch-size", "4096"]
    return [
        Step("machine and imports", script("machine.py", str(work / "machine.json")), 90,
             script("machine.py", str(work / "machine.json"))),
        Step("tests marked cuda", [PY, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "cuda",
                                   "-rs", "-q", "tests/test_cuda.py"], 180, None),
        Step("training through the daemon", script("daemon_training.py", str(work / "home-train")), 240,
             script("daemon_training.py", str(work / "home-train"), "--virtual")),
        Step("a stranger makes the GPU busy", script("busy_by_outsider.py", str(work / "home-busy")), 90, None,
             "needs a real driver (tests/test_nvml_scheduler.py covers it on the emulated one)"),
        Step("NCCL one-rank group", script("one_rank_group.py"), 90, script("one_rank_group.py", "--gloo")),
        Step("memory estimate vs measured", [PY, "scripts/bench_memory.py", "--device", "cuda"], 150,
             [PY, "scripts/bench_memory.py", "--only", "1"]),
        Step("bench_step fp32", [*bench, "--precision", "fp32"], 150, [*bench_cpu, "--precision", "fp32"]),
        Step("bench_step bf16", [*bench, "--precision", "bf16"], 150, [*bench_cpu, "--precision", "bf16"]),
        Step("app: Overview and Monitor", script("app_views.py", str(work / "home-app")), 120,
             script("app_views.py", str(work / "home-app"), "--virtual")),
        Step("daemon sampling the real driver", [PY, "scripts/bench_nvml_sampler.py", "--real", "--window", "5",
                                                 "--warmup", "4"], 60, None, "needs a real driver"),
        Step("two GPUs: NCCL scaling 1,2", two_gpus if gpus >= 2 else None, 240, None,
             f"needs 2 GPUs, {gpus} here (tests/test_cuda.py's 2-GPU training skips for the same reason)"
             if gpus < 2 else "needs CUDA"),
        Step("sharing and preemption", script("share_and_preempt.py", str(work / "home-share")), 120,
             script("share_and_preempt.py", str(work / "home-share"), "--virtual")),
    ]


def gpu_count() -> int:
    """GPUs the driver lists (nvidia-smi -L), without creating a CUDA context here."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def run_one(step: Step, argv: list[str], timeout_s: float, log_path: Path) -> Row:
    started = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        # The step's whole group goes (daemons it started run in sessions of their own and are
        # stopped by the step; a step killed here may leave one, which the machine's end takes).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    took = time.monotonic() - started
    text = log_path.read_text(errors="replace")
    detail = f"over its {timeout_s:.0f} s limit; last: {detail_of(text)}" if timed_out else detail_of(text)
    return Row(step.name, verdict_of(proc.returncode, timed_out), took, detail)


def archive_logs(work: Path, dest: Path) -> None:
    """Every log, job output and small record under `work` (no weights, shards or checkpoints)."""
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in LOG_SUFFIXES and path.stat().st_size < 4 * 2**20:
                tar.add(path, arcname=str(path.relative_to(work)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the verdict and the logs' archive go")
    p.add_argument("--work", type=Path, help="scratch folder (default: OUT/../gpu-check-work)")
    p.add_argument("--rehearse", action="store_true", help="no CUDA here: run what needs none, the device's way")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all the steps together")
    p.add_argument("--only", help="comma-separated step numbers (from 1), to rerun some")
    ns = p.parse_args()
    work = ns.work or ns.out.parent / "gpu-check-work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    gpus = gpu_count()
    plan = steps(work, gpus)
    only = {int(i) for i in ns.only.split(",")} if ns.only else set(range(1, len(plan) + 1))
    deadline = time.monotonic() + ns.budget
    rows: list[Row] = []
    for number, step in enumerate(plan, 1):
        if number not in only:
            continue
        argv = step.rehearse if ns.rehearse else step.argv
        left = deadline - time.monotonic()
        if argv is None:
            row = Row(step.name, "SKIP", None, ("left for the GPU: " if ns.rehearse else "") + step.why)
        elif left < MIN_STEP_S:
            row = Row(step.name, "SKIP", None, f"no time left in the check's {ns.budget:.0f} s budget")
        else:
            log = work / "logs" / f"{number:02d}-{step.name.split(':')[0].replace(' ', '_')}.log"
            print(f"[{number}/{len(plan)}] {step.name} (at most {min(step.timeout_s, left):.0f} s)", flush=True)
            row = run_one(step, argv, min(step.timeout_s, left), log)
        rows.append(row)
        print(f"    {row.verdict} {'' if row.seconds is None else f'{row.seconds:.0f} s '}{row.detail}", flush=True)

    machine = {"mode": "rehearsal (no CUDA)" if ns.rehearse else "GPU"}
    try:
        machine.update(json.loads((work / "machine.json").read_text()))
    except (OSError, ValueError):
        machine["facts"] = "unknown (the machine step did not finish)"
    (ns.out / "verdict.md").write_text(markdown(rows, machine))
    (ns.out / "verdict.json").write_text(to_json(rows, machine))
    archive_logs(work, ns.out / "logs.tar.gz")
    print("\n" + markdown(rows, machine))
    print(f"verdict: {ns.out / 'verdict.md'}, {ns.out / 'verdict.json'}; logs: {ns.out / 'logs.tar.gz'}")
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())

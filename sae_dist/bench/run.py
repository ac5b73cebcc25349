"""The scaling benchmark: each device count measured as DDP and as its no-communication ceiling,
`repeats` times, every point a process of its own (a scheduler job, or started here with
--no-queue). Rows go to benchmark_runs / benchmark_points as each point ends.

Strong scaling keeps the global batch (the config's batch_size) and splits it over N devices;
weak scaling keeps the per-device batch. The ceiling runs the same per-device work as N
independent single-device processes at the same time: on shared CPUs (or one shared GPU) that is
what the hardware allows without any communication, so efficiency is reported against it too.

sae_dist never imports the scheduler: a queued point is `python -m scheduler submit` in a
subprocess, followed through the jobs table.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func
from sqlmodel import Session, select

from sae_dist.bench import scaling
from sae_dist.config import TrainConfig
from sae_dist.db import FINAL_JOB_STATES, BenchmarkPoint, BenchmarkRun, GpuSample, Job, get_engine, utcnow
from sae_dist.errors import UserError

POINT_TIMEOUT_S = 3600.0
# The daemon writes its device samples every 5 s: wait that long before averaging them.
SAMPLE_FLUSH_WAIT_S = 6.0


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--devices {text!r}: give device counts separated by commas, e.g. 1,2,4") from None
    if not counts or any(n < 1 for n in counts):
        raise UserError(f"--devices {text!r}: give device counts of 1 or more, e.g. 1,2,4")
    counts = sorted(set(counts))
    if counts[0] != 1:
        counts.insert(0, 1)  # speedup and efficiency are against one device
    return counts


def device_kind(requested: str | None) -> str:
    """cuda where torch sees GPUs (or where asked), else cpu (virtual devices)."""
    import torch

    if requested in ("cuda", "cpu"):
        if requested == "cuda" and not torch.cuda.is_available():
            raise UserError("--device-kind cuda: no CUDA GPU is visible here")
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def environment(kind: str, max_count: int) -> dict:
    import torch

    if kind == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(min(max_count, torch.cuda.device_count()))]
        link = _nvml_link()
    else:
        names = [f"virtual GPU {i} (CPU-backed: {_cpu_model()})" for i in range(max_count)]
        link = None  # CPU ranks on one host talk through loopback TCP (gloo)
    return {"device_kind": kind, "device_names": json.dumps(names), "virtual": kind == "cpu",
            "backend": "nccl" if kind == "cuda" else "gloo", "torch_version": torch.__version__,
            "link": link, "host": socket.gethostname()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'}, {os.cpu_count()} cores"


def _nvml_link() -> str | None:
    """NVLink if GPU 0 has an active NVLink, else PCIe; None when NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            for link in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        return "NVLink"
                except pynvml.NVMLError:
                    break
            gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
            width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            return f"PCIe {gen}.0 x{width}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no GPU, an old driver: unknown, not invented
        return None


def run_benchmark(cfg: TrainConfig, counts: list[int], mode: str = "strong", steps: int = 30,
                  warmup: int = 5, repeats: int = 1, queued: bool = True, name: str | None = None,
                  kind: str | None = None, engine=None, log=print) -> int:
    """Measure every point; returns the benchmark run's id."""
    if mode not in ("strong", "weak"):
        raise UserError(f"--mode {mode!r}: choose strong or weak")
    for label, value in (("--steps", steps), ("--repeats", repeats)):
        if value < 1:
            raise UserError(f"{label} {value}: must be 1 or more")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be 0 or more")
    for n in counts:
        try:
            scaling.per_device_batch(mode, cfg.batch_size, n)
        except ValueError as e:
            raise UserError(f"--mode strong: {e}") from None
    kind = device_kind(kind)
    if kind == "cuda" and not queued:
        import torch

        if max(counts) > torch.cuda.device_count():
            raise UserError(f"--devices: {max(counts)} GPUs asked for, {torch.cuda.device_count()} visible")
    engine = engine or get_engine()
    with Session(engine) as s:
        bench = BenchmarkRun(name=name or f"{cfg.architecture}-{cfg.resolved_d_sae or 'auto'}-{mode}",
                             mode=mode, device_counts=json.dumps(counts), config_json=json.dumps(cfg.to_dict()),
                             steps=steps, warmup_steps=warmup, repeats=repeats, queued=queued,
                             **environment(kind, max(counts)))
        s.add(bench)
        s.commit()
        bench_id = bench.id
    log(f"benchmark {bench_id}: {mode} scaling on {counts} {kind} devices, {steps} timed steps "
        f"after {warmup} warm-up, {repeats} repeat(s), {'as scheduler jobs' if queued else 'directly'}")
    try:
        with tempfile.TemporaryDirectory(prefix="sae-dist-bench-") as tmp:
            for repeat in range(repeats):
                for n in counts:
                    batch = scaling.per_device_batch(mode, cfg.batch_size, n)
                    point_cfg = replace(cfg, batch_size=batch, devices=f"{kind}:{n}", db=False)
                    kinds = ("ddp", "ceiling") if n > 1 else ("ddp",)  # one device: nothing to compare
                    for what in kinds:
                        result, job_id = _measure_point(point_cfg, n, what, kind, steps, warmup, queued,
                                                        Path(tmp), f"{bench_id}-{n}-{what}-{repeat}")
                        row = _point_row(bench_id, n, repeat, what, result, job_id, engine)
                        log(f"  {n} device(s), {what:7s} repeat {repeat + 1}: {row.samples_per_s:,.0f} samples/s, "
                            f"step {row.step_s * 1e3:.1f} ms"
                            + (f", communication {row.comm_share:.0%}" if row.comm_share is not None else ""))
        if queued:
            _fill_utilization(engine, bench_id)
    except BaseException as e:
        _finish(engine, bench_id, "FAILED", f"{type(e).__name__}: {e}"[:2000])
        raise
    _finish(engine, bench_id, "COMPLETED", None)
    return bench_id


def _fill_utilization(engine, bench_id: int) -> None:
    """Each point's mean utilisation, once the daemon has written its samples (in batches)."""
    time.sleep(SAMPLE_FLUSH_WAIT_S)
    with Session(engine) as s:
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)).all()
        for point in points:
            point.mean_utilization_pct = _mean_utilization(engine, point.job_id)
            s.add(point)
        s.commit()


def _finish(engine, bench_id: int, status: str, error: str | None) -> None:
    with Session(engine) as s:
        bench = s.get(BenchmarkRun, bench_id)
        bench.status, bench.error, bench.finished_at = status, error, utcnow()
        s.add(bench)
        s.commit()


def _point_row(bench_id: int, n: int, repeat: int, what: str, result: dict, job_id: int | None,
               engine) -> BenchmarkPoint:
    share = None
    if result.get("step_no_comm_s") is not None:
        share = scaling.comm_share(result["step_s"], result["step_no_comm_s"])
    row = BenchmarkPoint(bench_id=bench_id, devices=n, repeat=repeat, kind=what,
                         per_device_batch=result["per_device_batch"], samples_per_s=result["samples_per_s"],
                         step_s=result["step_s"], step_no_comm_s=result.get("step_no_comm_s"),
                         comm_share=share, peak_memory=result.get("peak_memory"),
                         grad_bytes=result.get("grad_bytes"), job_id=job_id,
                         allreduce_bytes_per_s=result.get("allreduce_bytes_per_s"))
    with Session(engine) as s:
        s.add(row)
        s.commit()
        s.refresh(row)
    return row


def _mean_utilization(engine, job_id: int | None) -> float | None:
    """The mean of the daemon's samples of the job's devices while it ran; None without a job
    (a --no-queue point is not told apart from other work on the devices) or without samples."""
    if job_id is None:
        return None
    with engine.connect() as conn:
        value = conn.execute(select(func.avg(GpuSample.utilization_pct))
                             .where(GpuSample.job_id == job_id)).scalar()
    return float(value) if value is not None else None


def _measure_point(cfg: TrainConfig, n: int, what: str, kind: str, steps: int, warmup: int, queued: bool,
                   tmp: Path, tag: str) -> tuple[dict, int | None]:
    spec_path, result_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.result.json"
    spec = {"config": cfg.to_dict(), "warmup": warmup, "steps": steps, "kind": what, "devices": n}
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "sae_dist", "bench-point", str(spec_path), str(result_path)]
    job_id = None
    if queued:
        job_id = _submit(argv, n, f"bench-{tag}")
        job = _wait_job(job_id)
        if job.state != "COMPLETED":
            raise UserError(f"benchmark point {tag}: scheduler job {job_id} ended {job.state} "
                            f"(exit code {job.exit_code}); its log: {job.stdout_path}")
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=POINT_TIMEOUT_S)
        if done.returncode != 0:
            raise UserError(f"benchmark point {tag} failed (exit code {done.returncode}): "
                            f"{done.stderr.strip()[-1500:]}")
    if not result_path.exists():
        raise UserError(f"benchmark point {tag} wrote no result")
    return json.loads(result_path.read_text()), job_id


def _submit(argv: list[str], n: int, name: str) -> int:
    done = subprocess.run([sys.executable, "-m", "scheduler", "submit", "--gpus", str(n), "-J", name,
                           "--chdir", os.getcwd(), "--", *argv], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise UserError(f"could not queue a benchmark point: {done.stderr.strip() or done.stdout.strip()}")
    return int(done.stdout.split()[-1])


def _wait_job(job_id: int) -> Job:
    engine = get_engine()
    deadline = time.monotonic() + POINT_TIMEOUT_S
    while time.monotonic() < deadline:
        with Session(engine) as s:
            job = s.get(Job, job_id)
            if job is not None and job.state in FINAL_JOB_STATES:
                s.expunge(job)
                return job
        time.sleep(0.5)
    raise UserError(f"scheduler job {job_id} did not finish within {timedelta(seconds=POINT_TIMEOUT_S)}")

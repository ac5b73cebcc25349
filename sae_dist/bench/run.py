"""The scaling benchmark: each device count measured as DDP and as its no-communication ceiling,
`repeats` times, every point a process of its own (a scheduler job, or started here with
--no-queue). Rows go to benchmark_runs / benchmark_points as each point ends.

Repeats are interleaved across device counts (1, 2, 4, 1, 2, 4, ...), so that a drift in the
machine hits every count alike. A queued point is an exclusive scheduler job (`submit
--exclusive`): it holds every device of the machine, and on virtual devices it also waits until
no other job runs. Around each point the machine's other load is recorded
(sae_dist.bench.load), and after each point every count's reliability is judged again
(sae_dist.bench.reliability) and stored with its points.

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

from sae_dist.bench import reliability, scaling, summary
from sae_dist.bench.load import SAMPLE_EVERY_S, LoadMonitor
from sae_dist.config import TrainConfig
from sae_dist.db import (
    FINAL_JOB_STATES,
    BenchmarkPoint,
    BenchmarkRun,
    GpuSample,
    Job,
    get_engine,
    utcnow,
    write_session,
)
from sae_dist.errors import UserError

POINT_TIMEOUT_S = 3600.0  # a point's run, once started
START_WITHIN_S = 3600.0  # default wait for a queued point to get the machine alone
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
                  warmup: int = 5, repeats: int = 3, queued: bool = True, name: str | None = None,
                  kind: str | None = None, engine=None, log=print, start_within: float = START_WITHIN_S) -> int:
    """Measure every point, repeats interleaved across device counts; returns the benchmark run's
    id. A queued point that cannot get the machine alone within `start_within` seconds stops the
    benchmark with a UserError naming the jobs that held it."""
    if mode not in ("strong", "weak"):
        raise UserError(f"--mode {mode!r}: choose strong or weak")
    for label, value in (("--steps", steps), ("--repeats", repeats)):
        if value < 1:
            raise UserError(f"{label} {value}: must be 1 or more")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be 0 or more")
    if not start_within > 0:
        raise UserError(f"--start-within {start_within:g}: must be more than 0 seconds")
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
            for repeat, n, what in point_order(counts, repeats):
                batch = scaling.per_device_batch(mode, cfg.batch_size, n)
                point_cfg = replace(cfg, batch_size=batch, devices=f"{kind}:{n}", db=False)
                result, job_id, load = _measure_point(point_cfg, n, what, kind, steps, warmup, queued,
                                                      Path(tmp), f"{bench_id}-{n}-{what}-{repeat}",
                                                      start_within, engine)
                row = _point_row(bench_id, n, repeat, what, result, job_id, load, engine)
                other = reliability.point_load(load)["cpu_pct"]
                log(f"  {n} device(s), {what:7s} repeat {repeat + 1}: {row.samples_per_s:,.0f} samples/s, "
                    f"step {row.step_s * 1e3:.1f} ms"
                    + (f", communication {row.comm_share:.0%}" if row.comm_share is not None else "")
                    + (f", other load {other:.0f}% of a core" if other is not None else ""))
                store_reliability(engine, bench_id)
        if queued:
            _fill_utilization(engine, bench_id)
    except BaseException as e:
        _finish(engine, bench_id, "FAILED", (str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}")[:2000])
        raise
    _finish(engine, bench_id, "COMPLETED", None)
    for line in reliability.unreliable_lines(store_reliability(engine, bench_id)):
        log(f"  unreliable: {line}")
    return bench_id


def store_reliability(engine, bench_id: int) -> list[dict]:
    """Judge every device count from the points so far and store the verdict on its points;
    returns the summary rows."""
    with write_session(engine) as s:
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)).all()
        rows = summary.summarize([p.model_dump() for p in points])
        verdict = {r["devices"]: r for r in rows}
        for p in points:
            r = verdict.get(p.devices)
            p.reliable = r["reliable"] if r else True
            p.reason = r["reason"] if r else None
            s.add(p)
        s.commit()
    return rows


def _fill_utilization(engine, bench_id: int) -> None:
    """Each point's mean utilisation, once the daemon has written its samples (in batches)."""
    time.sleep(SAMPLE_FLUSH_WAIT_S)
    with write_session(engine) as s:
        points = s.exec(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)).all()
        for point in points:
            point.mean_utilization_pct = _mean_utilization(engine, point.job_id)
            s.add(point)
        s.commit()


def _finish(engine, bench_id: int, status: str, error: str | None) -> None:
    with write_session(engine) as s:
        bench = s.get(BenchmarkRun, bench_id)
        bench.status, bench.error, bench.finished_at = status, error, utcnow()
        s.add(bench)
        s.commit()


def point_order(counts: list[int], repeats: int) -> list[tuple[int, int, str]]:
    """(repeat, device count, kind) of every point, in the order they run: repeats interleaved
    across device counts (1, 2, 4, 1, 2, 4, ...), so a drift of the machine spreads over all of
    them; each count above one as DDP, then its no-communication ceiling (one device has none)."""
    return [(repeat, n, what) for repeat in range(repeats) for n in counts
            for what in (("ddp", "ceiling") if n > 1 else ("ddp",))]


def _point_row(bench_id: int, n: int, repeat: int, what: str, result: dict, job_id: int | None,
               other_load_json: str | None, engine) -> BenchmarkPoint:
    share = None
    if result.get("step_no_comm_s") is not None:
        share = scaling.comm_share(result["step_s"], result["step_no_comm_s"])
    row = BenchmarkPoint(bench_id=bench_id, devices=n, repeat=repeat, kind=what,
                         per_device_batch=result["per_device_batch"], samples_per_s=result["samples_per_s"],
                         step_s=result["step_s"], step_no_comm_s=result.get("step_no_comm_s"),
                         comm_share=share, peak_memory=result.get("peak_memory"),
                         grad_bytes=result.get("grad_bytes"), job_id=job_id,
                         allreduce_bytes_per_s=result.get("allreduce_bytes_per_s"),
                         other_load_json=other_load_json)
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
                   tmp: Path, tag: str, start_within: float, engine) -> tuple[dict, int | None, str]:
    """Run one point (a scheduler job, or a process here) and watch the machine's other load
    before and while it runs: (result, job id, other_load_json)."""
    spec_path, result_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.result.json"
    spec = {"config": cfg.to_dict(), "warmup": warmup, "steps": steps, "kind": what, "devices": n}
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "sae_dist", "bench-point", str(spec_path), str(result_path)]
    monitor = LoadMonitor(kind)
    monitor.baseline()
    job_id = None
    if queued:
        job_id = _submit(argv, n, f"bench-{tag}")
        try:
            job = _follow_job(job_id, tag, monitor, start_within, engine)
        except BaseException:
            _cancel(job_id)  # a pending or running point is never left behind
            raise
        if job.state != "COMPLETED":
            raise UserError(f"benchmark point {tag}: scheduler job {job_id} ended {job.state} "
                            f"(exit code {job.exit_code}); its log: {job.stdout_path}")
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        monitor.start_point()
        deadline = time.monotonic() + POINT_TIMEOUT_S
        while True:
            try:
                _, err = proc.communicate(timeout=SAMPLE_EVERY_S / 2)
                break
            except subprocess.TimeoutExpired:
                monitor.tick({proc.pid})
            if time.monotonic() > deadline:
                proc.kill()
                proc.communicate()
                raise UserError(f"benchmark point {tag} did not finish within {timedelta(seconds=POINT_TIMEOUT_S)}")
        if proc.returncode != 0:
            raise UserError(f"benchmark point {tag} failed (exit code {proc.returncode}): "
                            f"{err.strip()[-1500:]}")
    if not result_path.exists():
        raise UserError(f"benchmark point {tag} wrote no result")
    return json.loads(result_path.read_text()), job_id, monitor.finish()


def _submit(argv: list[str], n: int, name: str) -> int:
    done = subprocess.run([sys.executable, "-m", "scheduler", "submit", "--exclusive", "--json", "--gpus", str(n),
                           "-J", name, "--chdir", os.getcwd(), "--", *argv],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise UserError(f"could not queue a benchmark point: {said[-1] if said else f'exit code {done.returncode}'}")
    try:
        return int(json.loads(done.stdout)["job_id"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"could not queue a benchmark point: "
                        f"submit --json printed {done.stdout.strip()[:200]!r}") from None


def _cancel(job_id: int) -> None:
    subprocess.run([sys.executable, "-m", "scheduler", "cancel", str(job_id)], capture_output=True, timeout=120)


def running_jobs(engine, but: int | None = None) -> list[dict]:
    """The scheduler's running jobs (id, name, user), but one."""
    with Session(engine) as s:
        jobs = s.exec(select(Job).where(Job.state == "RUNNING").order_by(Job.id)).all()
        return [{"id": j.id, "name": j.name, "user": j.user} for j in jobs if j.id != but]


def held_by_text(jobs: list[dict]) -> str:
    return ", ".join(f"job {j['id']} {j['name']!r} (user {j['user']})" for j in jobs)


def _follow_job(job_id: int, tag: str, monitor: LoadMonitor, start_within: float, engine) -> Job:
    """Wait for the job to start (within start_within seconds) and to end, sampling the other
    load meanwhile: before it starts, then while it runs (its process tree is the point's)."""
    start_deadline = time.monotonic() + start_within
    run_deadline = None
    while True:
        with Session(engine) as s:
            job = s.get(Job, job_id)
            if job is None:
                raise UserError(f"benchmark point {tag}: scheduler job {job_id} vanished from the queue")
            s.expunge(job)
        if job.state in FINAL_JOB_STATES:
            return job
        if job.state == "RUNNING":
            if run_deadline is None:
                monitor.start_point()
                run_deadline = time.monotonic() + POINT_TIMEOUT_S
            monitor.note_jobs(running_jobs(engine, but=job_id))
            monitor.tick({p for p in (job.pid, job.pgid) if p})
            if time.monotonic() > run_deadline:
                raise UserError(f"benchmark point {tag}: scheduler job {job_id} did not finish within "
                                f"{timedelta(seconds=POINT_TIMEOUT_S)}; cancelled")
        else:
            monitor.tick(set())
            if time.monotonic() > start_deadline:
                others = running_jobs(engine, but=job_id)
                why = (f"held by {held_by_text(others)}" if others else
                       f"no other job was running; the scheduler's reason: {job.reason or 'none given'}")
                raise UserError(f"benchmark point {tag} could not get the machine alone within "
                                f"{start_within:g} s ({why}); the benchmark stopped and its job {job_id} "
                                "was cancelled")
        time.sleep(min(0.5, SAMPLE_EVERY_S / 2))

"""One benchmark point, measured inside the ranks: training steps timed with and without DDP's
gradient all-reduce. Runs as `python -m sae_dist bench-point SPEC RESULT` (torchrun's ranks for
DDP, or N independent single-device processes for the ceiling); rank 0 writes the result JSON.

The step is the trainer's (same model, optimizer, data source, decoder maintenance), without
logging, checkpoints or the database: what is timed is what training costs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from sae_dist import distributed as D
from sae_dist.bench.load import wait_scale
from sae_dist.config import TrainConfig, build_config
from sae_dist.contract import DEVICE_TYPE_ENV, THREADS_PER_RANK_ENV
from sae_dist.memory import PeakMemory


def measure(cfg: TrainConfig, warmup: int, steps: int, start_at: float | None = None) -> dict | None:
    """Time `steps` steps with the all-reduce, then `steps` under no_sync, after `warmup` steps.

    Returns rank 0's summary (None on the other ranks): medians of the slowest rank, peak memory
    of the largest rank, the bytes all-reduced per step. start_at (Unix time) lines up the
    independent processes of a ceiling measurement.
    """
    from sae_dist.data.sources.make import make_source
    from sae_dist.train.loop import set_threads
    from sae_dist.train.members import build_sae
    from sae_dist.train.step import autocast_for, optimizer_for, train_step, wrap_ddp

    ctx = D.init_distributed()
    set_threads(ctx)
    torch.manual_seed(cfg.seed)
    source = make_source(cfg, ctx)
    cfg = cfg.with_d_in(source.d_in)
    sae = build_sae(cfg, ctx.device)
    opt = optimizer_for(sae, cfg)
    model = wrap_ddp(sae, ctx, cfg)
    autocast = autocast_for(cfg, ctx.device)

    def step(sync: bool) -> float:
        t0 = time.perf_counter()
        batches = [source.next_batch(ctx.device) for _ in range(cfg.grad_accum)]
        with (nullcontext() if sync or ctx.world_size == 1 else model.no_sync()):
            train_step(model, sae, opt, batches, None, autocast)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return time.perf_counter() - t0

    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    peak = PeakMemory(ctx.device)
    peak.reset()
    for _ in range(warmup):
        step(True)
    D.barrier()
    synced = [step(True) for _ in range(steps)]
    D.barrier()
    unsynced = [step(False) for _ in range(steps)] if ctx.world_size > 1 else None
    D.barrier()
    bandwidth = _allreduce_bandwidth(sae, ctx) if ctx.world_size > 1 else None
    mine = {"step_s": statistics.median(synced),
            "step_no_comm_s": statistics.median(unsynced) if unsynced else None,
            "peak_memory": peak.peak_bytes()}
    ranks = D.gather_objects(mine)
    if not ctx.is_main:
        return None
    step_s = max(r["step_s"] for r in ranks)  # DDP moves at the slowest rank's pace
    no_comm = [r["step_no_comm_s"] for r in ranks if r["step_no_comm_s"] is not None]
    memory = [r["peak_memory"] for r in ranks if r["peak_memory"] is not None]
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "device_type": ctx.device.type,
        "per_device_batch": cfg.batch_size, "step_s": step_s,
        "step_no_comm_s": max(no_comm) if no_comm else None,
        "samples_per_s": cfg.batch_size * cfg.grad_accum * ctx.world_size / step_s,
        "peak_memory": max(memory) if memory else None,
        # DDP all-reduces every trainable parameter's gradient once per step.
        "grad_bytes": sum(p.numel() * p.element_size() for p in sae.parameters() if p.requires_grad),
        "allreduce_bytes_per_s": bandwidth,
        "started": time.time(),
    }


def _allreduce_bandwidth(sae, ctx, repeats: int = 5) -> float:
    """The ring all-reduce bandwidth between these ranks, measured on a buffer the size of the
    gradients: 2 (N - 1) / N x bytes / median time (NCCL's "bus bandwidth")."""
    import torch.distributed as dist

    numel = sum(p.numel() for p in sae.parameters() if p.requires_grad)
    buf = torch.ones(numel, dtype=torch.float32, device=ctx.device)
    times = []
    for i in range(repeats + 2):
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        D.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i >= 2:  # two warm-up rounds
            times.append(time.perf_counter() - t0)
    n = ctx.world_size
    return 2 * (n - 1) / n * numel * 4 / statistics.median(times)


def run_point(spec_path: str, result_path: str) -> None:
    """Entry of `bench-point` in each rank: read the spec, measure, rank 0 writes the result."""
    spec = json.loads(Path(spec_path).read_text())
    cfg = build_config(spec["config"])
    result = measure(cfg, spec["warmup"], spec["steps"], spec.get("start_at"))
    if result is not None:
        tmp = Path(f"{result_path}.tmp")  # beside it, unique per result (members: .0, .1, ...)
        tmp.write_text(json.dumps(result))
        os.replace(tmp, result_path)


def point(spec_path: str, result_path: str) -> int:
    """`bench-point`: a DDP point through torchrun's launcher (or in this process for one device),
    a ceiling as N independent single-device processes started together."""
    from sae_dist.train.launch import exit_rank, in_worker, launch

    spec = json.loads(Path(spec_path).read_text())
    if in_worker() or spec["kind"] == "member":
        run_point(spec_path, result_path)
        # Every rank is done once all reach here; then straight out. Gloo's teardown (by
        # destroy_process_group or at interpreter exit) sometimes aborts a rank with
        # std::terminate after its result is written, failing a good measurement.
        D.barrier()
        exit_rank(0)
    cfg = build_config(spec["config"])
    if spec["kind"] == "ddp":
        return launch(cfg, [spec_path, result_path], command="bench-point",
                      in_process=lambda: run_point(spec_path, result_path))
    return _ceiling(spec, spec_path, result_path)


def _ceiling(spec: dict, spec_path: str, result_path: str) -> int:
    import subprocess

    from sae_dist.errors import UserError

    n = spec["devices"]
    kind = spec["config"]["devices"].split(":")[0]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or [str(i) for i in range(n)]
    start_at = time.time() + 6.0 * wait_scale()  # after every process has imported torch
    procs, results = [], []
    for i in range(n):
        member = {**spec, "kind": "member", "config": {**spec["config"], "devices": f"{kind}:1"}, "start_at": start_at}
        member_spec, member_result = f"{spec_path}.{i}", f"{result_path}.{i}"
        Path(member_spec).write_text(json.dumps(member))
        env = {**os.environ, DEVICE_TYPE_ENV: kind}
        if kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = visible[i]
        else:  # the share of the cores a DDP rank gets on n devices
            threads = str(max(1, (os.cpu_count() or 1) // n))
            env.update({"OMP_NUM_THREADS": threads, THREADS_PER_RANK_ENV: threads})
        procs.append(subprocess.Popen([sys.executable, "-m", "sae_dist", "bench-point", member_spec, member_result],
                                      env=env, stderr=subprocess.PIPE, text=True))
        results.append(member_result)
    failed = []
    for i, proc in enumerate(procs):
        _, err = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"process {i}: exit code {proc.returncode}: {err.strip()[-500:]}")
    if failed:
        raise UserError("ceiling measurement failed: " + "; ".join(failed))
    members = [json.loads(Path(r).read_text()) for r in results]
    memory = [m["peak_memory"] for m in members if m["peak_memory"] is not None]
    summary = {**members[0], "world_size": n, "kind": "ceiling",
               "samples_per_s": sum(m["samples_per_s"] for m in members),
               "step_s": max(m["step_s"] for m in members), "step_no_comm_s": None,
               "peak_memory": max(memory) if memory else None}
    Path(result_path).write_text(json.dumps(summary))
    return 0

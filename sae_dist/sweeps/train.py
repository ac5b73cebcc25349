"""A sweep's loop: many SAEs trained in one job from one activation stream (issue 20).

Read top to bottom, as train.py: the process group and the data; the placement of the SAEs on
the ranks (sae_dist/sweeps/placement.py, printed and stored); the sweep's row and each SAE's run; start
or resume; then steps. Each step every rank reads its equal slice of the step's global batch from
the one stream (sources/base.py), so no sample is read twice; where an SAE's DDP group is not the
whole world the slices are all-gathered, so every rank holds the global batch, and each SAE trains
on its group rank's slice of it (a group of one: all of it). Shares stay equal: a sweep does not
rebalance. Every `log_every` steps each SAE reports (window.py: sums all-reduced over the world,
zeros from the ranks outside its group); NaN or inf in one SAE's loss stops that SAE only, its run
FAILED with the reason, the others go on. The pieces: sae_dist/sweeps/members.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract.sweep import Sweep
from sae_dist.data.harvest.sites import check_trainable
from sae_dist.errors import TrainingStopped
from sae_dist.memory import PeakMemory
from sae_dist.models.export import export_saelens
from sae_dist.sweeps.eval import evaluate_members
from sae_dist.sweeps.members import (
    Member,
    build_members,
    open_records,
    rank_devices,
    resume_members,
    split_sites,
    sweep_source,
    write_sweep_checkpoint,
)
from sae_dist.sweeps.placement import Placement, needs_for, place
from sae_dist.sweeps.record import SweepRecord
from sae_dist.train.balance import BatchPlan
from sae_dist.train.checkpoint import latest_checkpoint
from sae_dist.train.loop import (
    device_label,
    prepare_run_dir,
    received_stop,
    record_run_evaluation,
    set_threads,
    stop_on_signals,
)
from sae_dist.train.lr import lr_at
from sae_dist.train.state import on_main
from sae_dist.train.step import autocast_for, train_step
from sae_dist.train.window import TrainingDiverged, progress_line

log = logging.getLogger(__name__)


def train_sweep(cfg: TrainConfig, sweep: Sweep) -> list[Member]:
    ctx = D.init_distributed()
    with stop_on_signals():
        members = _train_sweep(cfg, sweep, ctx)
    D.shutdown()  # only after a good end, as train.py
    return members


def _train_sweep(cfg: TrainConfig, sweep: Sweep, ctx: D.DistContext) -> list[Member]:
    set_threads(ctx)
    torch.manual_seed(cfg.seed)
    source = sweep_source(cfg, sweep, ctx)  # from the model: every layer the sweep reads, one pass
    cfg = cfg.with_d_in(source.d_in).resolved(ctx.world_size)
    sweep = _resolved(sweep.with_d_in(source.d_in), ctx.world_size)
    # A torchrun started by hand skips the launcher's checks; the model source's config is read already.
    check_trainable(sweep, getattr(getattr(source, "reader", None), "config", None))
    memory = getattr(source, "memory", None)  # the model source's own, on every device
    placement = place(needs_for([(p.name, p.config) for p in sweep.points], ctx.device.type), rank_devices(ctx),
                      memory() if memory is not None else None)
    name, run_dir = on_main(ctx, prepare_run_dir, cfg)
    run_dir = Path(run_dir)
    device_ids = D.gather_objects(device_label(ctx))
    record = SweepRecord(cfg, ctx, name, str(run_dir), sweep, placement)
    members: list[Member] = []
    try:
        members = build_members(sweep, placement, ctx, run_dir, _global_plan(cfg, ctx), source)
        latest = latest_checkpoint(run_dir) if cfg.resume else None
        step = resume_members(members, ctx, source, latest) if latest is not None else 0
        open_records(members, ctx, name, record.sweep_id, device_ids)
        for m in members:
            if m.record is not None and latest is not None:
                m.record.resumed_at(step, len(m.ranks), [device_ids[r] for r in m.ranks])
        if ctx.is_main:
            _log_start(cfg, ctx, name, run_dir, placement, members, latest)
        _loop(cfg, ctx, source, members, step, run_dir, device_ids)
        evaluated = evaluate_members(cfg, ctx, source, members, _global_plan(cfg, ctx))
        _finish(cfg, ctx, members, name, evaluated)
    except BaseException as e:
        stopped = isinstance(e, TrainingStopped) or bool(received_stop)
        why = "stopped (a cancel, a time limit or Ctrl-C)" if stopped else f"{type(e).__name__}: {e}"[:2000]
        for m in members:
            if m.record is not None and m.live:
                m.record.finish(status="STOPPED" if stopped else "FAILED", error=why)
        record.finish("STOPPED" if stopped else "FAILED", why)
        raise
    status, note = _sweep_end(members)
    if note and ctx.is_main:
        log.warning("%s", note)
    record.finish(status, note)
    D.barrier()
    return members


def _loop(cfg: TrainConfig, ctx: D.DistContext, source, members: list[Member], step: int, run_dir: Path,
          device_ids: list[str]) -> None:
    plan = _global_plan(cfg, ctx)
    gather = any(len(m.ranks) < ctx.world_size for m in members)
    n_sites = len(getattr(source, "sites", ()))  # > 1: rows [rows, n_sites, d_in], each SAE its slice
    autocast = autocast_for(cfg, ctx.device)
    peak = PeakMemory(ctx.device)
    peak.reset()
    first = None
    if step == 0:
        first = source.next_batches(plan, ctx.rank, ctx.device)
        _init_b_dec(members, split_sites(first, n_sites))
    started, first_step = time.perf_counter(), step
    while step < cfg.steps:
        step += 1
        at_checkpoint = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps
        report = at_checkpoint or step % cfg.log_every == 0
        t0 = time.perf_counter()
        local = first or source.next_batches(plan, ctx.rank, ctx.device)
        first = None
        batches = split_sites(_all_gathered(local) if gather else local, n_sites)
        local = split_sites(local, n_sites) if gather else batches
        grad_norms = torch.zeros(len(members), dtype=torch.float64)
        for i, m in enumerate(members):
            if not (m.here and m.live):
                continue
            lr = lr_at(step, m.cfg.resolved_lr, cfg.steps, m.cfg.lr_warmup_steps, m.cfg.lr_decay_fraction)
            for group in m.opt.param_groups:
                group["lr"] = lr
            xs = local[m.site] if len(m.ranks) == ctx.world_size else m.slices(batches[m.site], ctx.rank)
            result = train_step(m.model, m.sae, m.opt, xs, m.state.dead, autocast, grad_norm=report,
                                loss_scale=m.plan.loss_scale(m.group_rank(ctx.rank)))
            m.window.add(xs, result.outputs)
            if report and ctx.rank == m.leader:
                grad_norms[i] = result.grad_norm
        for m in members:
            m.window.end_step(t0, time.perf_counter() - t0)
        if not report:
            continue
        _report(cfg, ctx, members, step, plan, D.all_reduce_sum(grad_norms.to(ctx.device)).tolist(), peak,
                device_ids)
        if ctx.is_main:
            log.info("step %d/%d: %d SAEs training, %.1f steps/s", step, cfg.steps,
                     sum(m.live for m in members), (step - first_step) / max(time.perf_counter() - started, 1e-9))
        if at_checkpoint:
            write_sweep_checkpoint(cfg, ctx, members, source, step, run_dir)
        for m in members:
            m.window.started = time.perf_counter()  # the checkpoint's time is not the next window's


def _report(cfg: TrainConfig, ctx: D.DistContext, members: list[Member], step: int, plan: BatchPlan,
            grad_norms: list[float], peak: PeakMemory, device_ids: list[str]) -> None:
    """Each live SAE's window into its metrics (the same numbers on every rank); one whose loss
    went NaN or inf stops here, on every rank at once."""
    for i, m in enumerate(members):
        if not m.live:
            continue
        try:
            w = m.window.report(step, m.state, m.cfg.dead_after_samples, m.run_dir, peak)
        except TrainingDiverged as e:
            m.failed = f"SAE {m.name} stopped at step {step}: {e} The sweep's other SAEs go on."
            _drop(m)
            if m.record is not None:
                log.warning("%s", m.failed)
                m.record.finish(status="FAILED", error=m.failed, last_step=step)
            continue
        lr = lr_at(step, m.cfg.resolved_lr, cfg.steps, m.cfg.lr_warmup_steps, m.cfg.lr_decay_fraction)
        m.last_metrics = w.metrics(lr, grad_norms[i], None, None)
        if m.record is not None:
            m.record.log(m.last_metrics, step, [r for r in w.rank_rows(device_ids, plan) if r["rank"] in m.ranks])
            if len(members) <= 8 or i == 0:
                log.info("%s: %s", m.name, progress_line(step, cfg.steps, m.last_metrics, []))


def _drop(m: Member) -> None:
    """A stopped SAE's memory goes back; its group's ranks step it no more (all decided alike)."""
    m.sae = m.opt = m.model = None


def _finish(cfg: TrainConfig, ctx: D.DistContext, members: list[Member], sweep_name: str,
            evaluated: dict[str, tuple]) -> None:
    """Each live SAE's SAELens export (its leader writes it), its run's final numbers and its
    end-of-run evaluation (rank 0; sae_dist/sweeps/eval.py)."""
    step = cfg.steps
    for m in members:
        if not m.live:
            continue
        export_dir = m.run_dir / "sae"
        if ctx.rank == m.leader:
            density = m.state.fire_total / max(m.state.samples_total, 1)
            export_saelens(m.sae, export_dir, density,
                           metadata={"run_name": m.run_dir.name, "sweep": sweep_name, "sweep_point": m.name})
        if m.record is not None:
            lm = m.last_metrics
            m.record.finish(status="COMPLETED", export_dir=str(export_dir.resolve()), last_step=step,
                            final_loss=lm.get("loss"), final_mse=lm.get("mse"), final_fvu=lm.get("fvu"),
                            final_l0=lm.get("l0"), final_dead_fraction=lm.get("dead_fraction"),
                            final_samples_per_s=lm.get("samples_per_s"))
            if m.name in evaluated:
                record_run_evaluation(m.cfg, m.record, m.run_dir, export_dir.resolve(), *evaluated[m.name])
    D.barrier()


def _sweep_end(members: list[Member]) -> tuple[str, str | None]:
    """The sweep row's end: COMPLETED while one SAE at least completed, with how many failed."""
    failed = [m for m in members if not m.live]
    if not failed:
        return "COMPLETED", None
    note = f"{len(failed)} of {len(members)} SAEs failed: " + "; ".join(m.failed for m in failed)
    return ("FAILED" if len(failed) == len(members) else "COMPLETED"), note[:4000]


# ---- pieces ----


def _resolved(sweep: Sweep, world_size: int) -> Sweep:
    import dataclasses

    points = tuple(dataclasses.replace(p, config=p.config.resolved(world_size)) for p in sweep.points)
    return Sweep(sweep.keys, points)


def _global_plan(cfg: TrainConfig, ctx: D.DistContext) -> BatchPlan:
    """Equal shares of the global batch, as train.py's with --balance equal: a sweep does not
    rebalance (its SAEs' groups would each want other shares of the one stream)."""
    return BatchPlan(cfg.batch_size * ctx.world_size * cfg.grad_accum, cfg.grad_accum,
                     (cfg.batch_size,) * ctx.world_size)


def _all_gathered(local: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's equal slice of each micro-batch, in rank order: the step's global batch on
    every rank. Each sample was read once, by one rank; this shares it, it does not read it again."""
    out = []
    for x in local:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        out.append(torch.cat(parts))
    return out


def _init_b_dec(members: list[Member], first: dict[int | None, list[torch.Tensor]]) -> None:
    """b_dec at the mean of the first global batch of its site (all-reduced), for every SAE, as
    train_state."""
    with torch.no_grad():
        for site, batches in first.items():
            local = torch.cat(batches)
            total = D.all_reduce_sum(torch.cat([local.sum(0), local.new_tensor([len(local)])]))
            for m in members:
                if m.here and m.site == site:
                    m.sae.b_dec.copy_(total[:-1] / total[-1])


def _log_start(cfg: TrainConfig, ctx: D.DistContext, name: str, run_dir: Path, placement: Placement,
               members: list[Member], latest: Path | None) -> None:
    log.info("sweep %s: %d SAEs from one %s stream on %d x %s (%s), global batch %d; equal shares of each "
             "step (a sweep does not rebalance)", name, len(members), cfg.source, ctx.world_size,
             ctx.device.type, ctx.backend, cfg.batch_size * ctx.world_size * cfg.grad_accum)
    for line in placement.lines():
        log.info("%s", line)
    for m in members:
        log.info("  %s: %s SAE d_sae=%d, lr %.2e, ranks %s%s", m.name, m.cfg.architecture, m.cfg.resolved_d_sae,
                 m.cfg.resolved_lr, list(m.ranks), f" (failed before: {m.failed})" if m.failed else "")
    if latest is not None:
        log.info("resumed from %s", latest)
    log.info("run directory: %s (each SAE under saes/)", run_dir)


def sweep_summary(members: list[Member]) -> dict[str, Any]:
    """Per SAE its end and final numbers (tests, the benchmark)."""
    return {m.name: {"failed": m.failed, **m.last_metrics} for m in members}


"""The training loop of one rank, for one SAE or a sweep of many: DDP over the devices torchrun
gave us, rank 0 logs and writes.

Read top to bottom it is the whole story: set up the process group and the data; the job's SAEs
(a single run is one SAE on every rank; a sweep places its SAEs on the ranks,
sae_dist.sweeps.placement); start fresh (b_dec from the first batch) or resume from the latest
checkpoint; then steps. Each step every rank reads its share of the step's global batch from the
one stream, and each SAE it holds takes a forward / backward (DDP all-reduces the gradients over
the SAE's group) / decoder constraint / Adam step on its rows (sae_dist.train.members). Every
`log_every` steps one report per SAE all-reduces the window's sums into its metrics and
dead-latent counters (NaN or inf stops that SAE: a single run fails, a sweep's other SAEs go on)
and gathers every rank's timings, from which every rank takes the same decision to move the
stream's shares. Checkpoints, the end-of-run evaluation and the SAELens exports follow. The
pieces: sae_dist.train.state (start, resume, checkpoint), .window (the report), .shares and
.balance (who reads how much of a step), .members (the SAEs on this rank), .run_record (the
database). See docs/architecture.md.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract import (
    KILL_RANK_AT_ENV,
    PAUSE_RANK_AT_ENV,
    RESTART_NOTE_ENV,
    TERM_RANK_AT_ENV,
    THREADS_PER_RANK_ENV,
    rank_values,
)
from sae_dist.contract.sweep import Sweep
from sae_dist.data.harvest.sites import check_trainable
from sae_dist.data.sources.make import make_source, source_in_words
from sae_dist.defaults import DEAD_CHECK_STEPS
from sae_dist.errors import TrainingStopped
from sae_dist.evaluate.end_of_run import end_of_run_evaluations, summary_lines
from sae_dist.evaluate.metrics import dictionary_recovery
from sae_dist.memory import MemoryEstimate, PeakMemory, estimate_for_config
from sae_dist.models.export import export_saelens
from sae_dist.sweeps.placement import Placement, PlacementError, place_sweep
from sae_dist.sweeps.record import SweepRecord
from sae_dist.sweeps.setup import rank_devices, resolved, sweep_source
from sae_dist.train import refit
from sae_dist.train.balance import BalanceDecision, BatchPlan, rebalance
from sae_dist.train.checkpoint import check_run_dir, latest_checkpoint
from sae_dist.train.inner_weight import inner_weight_at
from sae_dist.train.lr import lr_at
from sae_dist.train.members import (
    Member,
    all_gathered,
    build_member,
    follow_stream,
    init_b_dec,
    open_sweep_records,
    split_sites,
)
from sae_dist.train.run_record import RunRecord
from sae_dist.train.shares import slowdown_for_tests
from sae_dist.train.state import Stream, first_stream, on_main, resume, write_checkpoint
from sae_dist.train.step import StepResult, autocast_for, set_lr, train_step, use_bf16, wrap_ddp
from sae_dist.train.window import TrainingDiverged, WindowReport, progress_line

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    run_id: int | None  # a single run's row (None for a sweep, whose SAEs each have one)
    export_dir: Path | None
    step: int
    final: dict[str, Any] = field(default_factory=dict)  # no model here: it must not outlive the process group


@dataclass
class Job:
    """What this rank trains and where it goes: the same on every rank but for the weights."""

    cfg: TrainConfig
    ctx: D.DistContext
    source: Any  # the one ActivationSource every SAE reads
    name: str
    run_dir: Path
    device_ids: list[str]
    record: RunRecord | SweepRecord  # the run's row, or the sweep's (each SAE then has its own run)
    sweep: Sweep | None = None
    placement: Placement | None = None
    members: list[Member] = field(default_factory=list)
    slowdown: float = 1.0  # test knob: this rank's compute slowed by this factor
    kill_at: tuple[int, signal.Signals | None] | None = None  # test knob: (step, signal it sends itself)

    @property
    def records(self) -> list[RunRecord]:
        """The run rows of the SAEs still training (rank 0; empty elsewhere)."""
        return [m.record for m in self.members if m.record is not None and m.live]

    @property
    def n_sites(self) -> int:
        """Sites the source's rows hold: above 1, rows [rows, n_sites, d_in], each SAE its slice."""
        return len(getattr(self.source, "sites", ()))

    @property
    def balances(self) -> bool:
        """Whether the stream's shares change any device's work: only for an SAE on several ranks
        (an SAE on one device trains on the whole global batch, whoever read it)."""
        return self.ctx.world_size > 1 and any(len(m.ranks) > 1 for m in self.members if m.live)


def train(cfg: TrainConfig, sweep: Sweep | None = None) -> TrainResult:
    ctx = D.init_distributed()
    with stop_on_signals():
        result = _train(cfg, sweep, ctx)
    # The models go before the process group: DDP's reducer holds the group, and a gloo group torn
    # down by a reducer after destroy_process_group can wait forever on its threads.
    gc.collect()
    # Only a run that ended well tears the process group down: after an error a peer may be
    # gone already, and gloo's teardown then aborts the process (std::terminate).
    D.shutdown()
    return result


def _train(cfg: TrainConfig, sweep: Sweep | None, ctx: D.DistContext) -> TrainResult:
    set_threads(ctx)
    torch.manual_seed(cfg.seed)
    # The test knobs first: a bad one is one error before anything starts.
    slowdown, kill_at = slowdown_for_tests(ctx.rank), kill_step_for_tests(ctx.rank)
    # Each wait before the first step is said as it begins: the Monitor shows a starting job's
    # last log line, and loading a model can take minutes.
    if ctx.is_main:
        log.info("%d rank%s joined; opening the data source: %s", ctx.world_size, "s" * (ctx.world_size > 1),
                 source_in_words(cfg))
    source = make_source(cfg, ctx) if sweep is None else sweep_source(cfg, sweep, ctx)
    # Rule-based defaults become numbers here, so the run's stored config says what it ran with.
    cfg = cfg.with_d_in(source.d_in).resolved(ctx.world_size)
    placement = None
    if sweep is not None:
        sweep = resolved(sweep.with_d_in(source.d_in), ctx.world_size)
        # A torchrun started by hand skips the launcher's checks; the model source's config is read already.
        check_trainable(sweep, getattr(getattr(source, "reader", None), "config", None))
        memory = getattr(source, "memory", None)  # the model source's own, on every device
        placement = _placement(sweep, ctx, memory() if memory is not None else None)
    name, run_dir = on_main(ctx, prepare_run_dir, cfg)
    device_ids = D.gather_objects(device_label(ctx))
    record = (RunRecord(cfg, ctx, name, run_dir, device_ids) if sweep is None
              else SweepRecord(cfg, ctx, name, run_dir, sweep, placement))
    job = Job(cfg, ctx, source, name, Path(run_dir), device_ids, record, sweep, placement,
              slowdown=slowdown, kill_at=kill_at)
    try:
        return _run(job)
    except BaseException as e:
        # A peer's error caused by its own stop is a stop too.
        stop = e if isinstance(e, TrainingStopped) else TrainingStopped(received_stop[0]) if received_stop else None
        why = (f"stopped by {stop.signame} (a cancel, a preemption, a time limit or Ctrl-C)"
               + (f"; checkpoint at step {stop.checkpoint_step}: --resume goes on from it"
                  if stop.checkpoint_step is not None else "") if stop
               else f"{type(e).__name__}: {e}"[:2000])
        status = "STOPPED" if stop else "FAILED"
        for r in job.records:
            r.finish(status=status, error=why)
        if isinstance(record, SweepRecord):
            record.finish(status, why)
        elif record not in job.records:  # it failed before its SAE was built
            record.finish(status=status, error=why)
        if stop is not None and stop is not e:
            raise stop from None
        raise


def _run(job: Job) -> TrainResult:
    cfg, ctx = job.cfg, job.ctx
    peak = PeakMemory(ctx.device)
    peak.reset()
    slowdown, kill_at = job.slowdown, job.kill_at
    estimate = estimate_for_config(cfg, ctx.world_size, ctx.device.type)
    step, stream, first = _start(job, slowdown, estimate)
    for m in job.members:
        m.window.started = time.perf_counter()  # the start's reading and probing are not the first window's
    gather = any(len(m.ranks) < ctx.world_size for m in job.members)
    autocast = autocast_for(cfg, ctx.device)
    started, first_step, limited_reported = time.perf_counter(), step, None
    lead: WindowReport | None = None  # the last report's (its peak memory is the run's)

    deferred_stop.append(True)  # from here a signal stops the run at its next report, checkpointed
    while step < cfg.steps:
        step += 1
        at_checkpoint = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps
        report = at_checkpoint or step % cfg.log_every == 0
        t0 = time.perf_counter()
        local = first or job.source.next_batches(stream.plan, ctx.rank, ctx.device)
        first = None
        compute = time.perf_counter() - t0  # a rank's compute: its reading and its forwards, no collective
        gathered = split_sites(all_gathered(local, stream.plan), job.n_sites) if gather else None
        local = split_sites(local, job.n_sites)
        grad_norms = torch.zeros(len(job.members), dtype=torch.float64)
        for i, m in enumerate(job.members):
            if not (m.here and m.live):
                continue
            xs = m.rows(local[m.site], gathered[m.site] if len(m.ranks) < ctx.world_size else None, ctx.rank)
            m_started = time.perf_counter()
            result = _train_member(job, m, xs, step, report, autocast)
            compute += result.forward_done - m_started
            if report and ctx.rank == m.leader:
                grad_norms[i] = result.grad_norm
        for m in job.members:
            m.window.end_step(t0, compute)
        if step % DEAD_CHECK_STEPS == 0:
            for m in job.members:
                if m.live:
                    m.window.check(m.state, step, DEAD_CHECK_STEPS * stream.plan.global_batch,
                                   m.cfg.dead_after_samples)
        if step == cfg.steps:  # before the last checkpoint, which keeps the refit decoders
            refit.refit_decoders(job.members, ctx.rank, cfg.steps)
        if kill_at and step == kill_at[0]:  # test-only: a device that dies, or a preemption, for real
            os.kill(os.getpid(), kill_at[1]) if kill_at[1] else _wait_for_a_signal()
        if not report:
            continue

        # ---- one report: a few small collectives for each SAE's window ----
        closed = _close_windows(job, step, peak)
        if closed:
            # Every rank decides from the same gathered numbers and the same state: the same new
            # shares everywhere. Every SAE's window timed the same steps: the first one's will do.
            lead = closed[0][1]
            decision = rebalance(stream.plan.shares, lead.times, stream.balance, allowed=cfg.rebalance and job.balances)
            stream.balance = decision.state
            # Where shares change no device's work (each SAE on a device of its own), a slow rank is
            # no balance limit: the shares were never the way to even it out.
            limited = decision.limited_rank if job.balances else None
            _record_reports(job, step, stream.plan, closed, D.all_reduce_sum(grad_norms.to(ctx.device)).tolist(),
                            limited, at_checkpoint)
            if ctx.is_main:
                _log_progress(job, step, lead, (step - first_step) / max(time.perf_counter() - started, 1e-9))
            _apply_balance(job, stream, step, decision, lead, limited, limited_reported)
            limited_reported = limited
        if at_checkpoint:
            _write_checkpoint(job, stream, step)
        if step < cfg.steps and stop_agreed(ctx):
            _stop_with_checkpoint(job, stream, step, at_checkpoint)
        for m in job.members:
            m.window.started = time.perf_counter()  # the checkpoint's time is not the next window's

    deferred_stop.clear()  # the evaluation and export: a signal stops them at once
    return _finish(job, stream, step, lead.peak_bytes if lead else None, estimate)


def _train_member(job: Job, m: Member, xs: list[torch.Tensor], step: int, report: bool, autocast) -> StepResult:
    """One SAE's optimizer step on this rank's rows `xs` of it, added to its window (and to its
    decoder refit's sums, inside the refit's window)."""
    cfg = job.cfg
    set_lr(m.opt, lr_at(step, m.cfg.resolved_lr, cfg.steps, m.cfg.lr_warmup_steps, m.cfg.lr_decay_fraction),
           m.cfg.resolved_decoder_lr_factor)
    if m.inner_weight is not None:
        m.sae.matryoshka_inner_weight = inner_weight_at(step, cfg.steps, *m.inner_weight)
    result = train_step(m.model, m.sae, m.opt, xs, m.state.dead, autocast, grad_norm=report,
                        loss_scale=m.plan.loss_scale(m.group_rank(job.ctx.rank)), slowdown=job.slowdown,
                        selection_bias=m.state.selection_bias)
    m.window.add([m.sae.split(x)[1] for x in xs], result.outputs)  # a transcoder is judged on y
    refit.gather(m, result.outputs, step, cfg.steps)
    return result


def _write_checkpoint(job: Job, stream: Stream, step: int) -> None:
    """The step's checkpoint, the firings since the last dead-set check parked in it first
    (none to park at a check's own step)."""
    if step % DEAD_CHECK_STEPS:
        for m in job.members:
            if m.live:
                m.window.park_fired(m.state)
    write_checkpoint(job.cfg, job.ctx, job.members, job.source, stream, step, job.run_dir)


def stop_agreed(ctx: D.DistContext) -> bool:
    """Whether any rank was signalled: every rank asks at the same step (a report), so all stop
    there together, each with its part of one checkpoint."""
    asked = torch.tensor([float(bool(received_stop))], device=ctx.device)
    return bool(D.all_reduce_sum(asked).item() > 0)


def _stop_with_checkpoint(job: Job, stream: Stream, step: int, written: bool) -> None:
    """A stop asked for during the steps (a cancel, a preemption, a time limit's warning, Ctrl-C):
    the step's checkpoint, so `--resume` goes on from here exactly as if nothing had happened."""
    if not written:
        _write_checkpoint(job, stream, step)
    if job.ctx.is_main:
        log.info("stopping at step %d: checkpoint written; --resume goes on from it", step)
    raise TrainingStopped(received_stop[0] if received_stop else signal.SIGTERM, checkpoint_step=step)


def _start(job: Job, slowdown: float, estimate: MemoryEstimate) -> tuple[int, Stream, list[torch.Tensor] | None]:
    """The job's SAEs built, started fresh or resumed, wrapped for DDP and recorded: (the step,
    the stream's shares, the first step's rows on a fresh start, b_dec set from them)."""
    cfg, ctx = job.cfg, job.ctx
    if ctx.is_main:
        log.info("building %s", "the SAE" if job.sweep is None else f"{len(job.sweep)} SAEs")
    job.members = _build_members(job)
    # The stream's first shares, by --balance: a sweep's SAEs are apart (shares change no device's
    # work) only with --balance equal, or on one device, where shares are equal anyway.
    probe = [m.sae for m in job.members if m.here and len(m.ranks) > 1]
    latest = latest_checkpoint(job.run_dir) if cfg.resume else None
    if latest is not None:
        step, stream = resume(cfg, ctx, job.members, job.source, latest, job.run_dir, probe, slowdown)
    else:
        step, stream = 0, first_stream(cfg, ctx, probe, slowdown)
    follow_stream(job.members, stream.plan)
    for m in job.members:
        if m.here:
            m.model = wrap_ddp(m.sae, ctx, m.cfg, ranks=len(m.ranks), group=m.group)
    _open_records(job, step, stream.plan, resumed=latest is not None)
    if ctx.is_main:
        _log_start(job, stream, estimate, latest)
    if step > 0:
        return step, stream, None
    if ctx.is_main:
        log.info("reading the first batch, then the first %d steps before the first metrics", cfg.log_every)
    first = job.source.next_batches(stream.plan, ctx.rank, ctx.device)
    init_b_dec(job.members, split_sites(first, job.n_sites))
    return step, stream, first


def _placement(sweep: Sweep, ctx: D.DistContext, source_memory) -> Placement:
    """The sweep on this job's ranks. After a lost device the launcher restarts the job on the
    others: a sweep that no longer fits them ends here, with its checkpoints, for --resume."""
    try:
        return place_sweep(sweep, ctx.device.type, rank_devices(ctx), source_memory)
    except PlacementError as e:
        if not os.environ.get(RESTART_NOTE_ENV):
            raise
        raise PlacementError(f"{e}. A device was lost and the sweep cannot go on on the {ctx.world_size} left; "
                             f"its checkpoints are kept: train again with --resume on enough devices") from None


def _build_members(job: Job) -> list[Member]:
    """A single run: one SAE on every rank, in the run's own folder, its row the run's. A sweep:
    each SAE on the ranks of its placement, in saes/<name>; a source of several model sites
    gives each SAE its site."""
    ctx, every = job.ctx, tuple(range(job.ctx.world_size))
    equal = BatchPlan(job.cfg.batch_size * ctx.world_size * job.cfg.grad_accum, job.cfg.grad_accum,
                      (job.cfg.batch_size,) * ctx.world_size)  # until the start sets the stream's shares
    if job.sweep is None:
        member = build_member(job.name, job.cfg, every, job.run_dir, equal, ctx)
        member.record = job.record if ctx.is_main else None
        return [member]
    names = [d.device for d in job.placement.devices]
    site_of = getattr(job.source, "site_of", None)
    return [build_member(p.name, p.config, tuple(sorted(names.index(d) for d in job.placement.group_of(p.name))),
                         job.run_dir / "saes" / p.name, equal, ctx,
                         site=site_of(p.config.model_layer, p.config.model_site) if site_of else None)
            for p in job.sweep.points]


def _open_records(job: Job, step: int, plan: BatchPlan, resumed: bool) -> None:
    """A sweep's run row for each SAE still training; on a resume every row says so, and a
    restart without a lost device is an event beside the curves."""
    if job.sweep is not None:
        open_sweep_records(job.members, job.ctx, job.name, job.record.sweep_id, job.device_ids)
    if not resumed:
        return
    for i, m in enumerate(m for m in job.members if m.record is not None):
        m.record.resumed_at(step, len(m.ranks), [job.device_ids[r] for r in m.ranks])
        m.record.restart_event(step, plan, say=i == 0)


def _close_windows(job: Job, step: int, peak: PeakMemory) -> list[tuple[int, WindowReport]]:
    """Each live SAE's window all-reduced (the same numbers on every rank). One whose loss went
    NaN or inf stops here, on every rank at once: a single run fails, a sweep's other SAEs go on."""
    closed = []
    for i, m in enumerate(job.members):
        if not m.live:
            continue
        try:
            closed.append((i, m.window.report(step, m.state, m.run_dir, peak)))
        except TrainingDiverged as e:
            if job.sweep is None:
                raise
            m.failed = f"SAE {m.name} stopped at step {step}: {e} The sweep's other SAEs go on."
            m.sae = m.opt = m.model = None  # its memory goes back; its group steps it no more
            if m.record is not None:
                log.warning("%s", m.failed)
                m.record.finish(status="FAILED", error=m.failed, last_step=step)
    return closed


def _record_reports(job: Job, step: int, plan: BatchPlan, closed: list[tuple[int, WindowReport]],
                    grad_norms: list[float], limited_rank: int | None, at_checkpoint: bool) -> None:
    """Each SAE's metrics from its window (planted-feature recovery at checkpoints, where rank 0
    holds the SAE), and rank 0's rows: the metrics and its group's ranks' timings."""
    planted = job.source.planted_features
    for i, w in closed:
        m = job.members[i]
        lr = lr_at(step, m.cfg.resolved_lr, job.cfg.steps, m.cfg.lr_warmup_steps, m.cfg.lr_decay_fraction)
        recovery = (dictionary_recovery(planted, m.sae.W_dec)
                    if planted is not None and at_checkpoint and m.here and job.ctx.is_main else None)
        m.last_metrics = w.metrics(lr, grad_norms[i], limited_rank, recovery)
        if m.record is not None:
            m.record.log(m.last_metrics, step, [r for r in w.rank_rows(job.device_ids, plan) if r["rank"] in m.ranks])


def _log_progress(job: Job, step: int, lead: WindowReport, steps_per_s: float) -> None:
    live = [m for m in job.members if m.live]
    if job.sweep is None:
        log.info("%s", progress_line(step, job.cfg.steps, live[0].last_metrics, lead.stragglers))
        return
    for i, m in enumerate(live):
        if len(live) <= 8 or i == 0:
            log.info("%s: %s", m.name, progress_line(step, job.cfg.steps, m.last_metrics, []))
    log.info("step %d/%d: %d SAEs training, %.1f steps/s", step, job.cfg.steps, len(live), steps_per_s)


def _apply_balance(job: Job, stream: Stream, step: int, decision: BalanceDecision, w: WindowReport,
                   limited: int | None, limited_reported: int | None) -> None:
    """The rebalancer's decision takes effect from the next step for every SAE; rank 0 records a
    move, and a rank that stays slow even at its smallest share (once, until that changes)."""
    if decision.changed(stream.plan.shares):
        before = stream.plan
        stream.plan = BatchPlan(before.global_batch, before.micro_steps, decision.shares)
        follow_stream(job.members, stream.plan)
        for i, r in enumerate(job.records):
            r.rebalanced(step, before, stream.plan, w.compute_times, decision, say=i == 0)
    if limited is not None and limited != limited_reported:
        for i, r in enumerate(job.records):
            r.balance_limited(step, decision, say=i == 0)


def _finish(job: Job, stream: Stream, step: int, last_peak: int | None, estimate: MemoryEstimate) -> TrainResult:
    """The end: every live SAE evaluated on rows never trained on, exported once (by its group's
    first rank), its final numbers recorded; then the sweep's own end."""
    ctx = job.ctx
    evaluated = end_of_run_evaluations(job.cfg, ctx, job.source, job.members, stream.plan)
    final: dict[str, Any] = {}
    for m in job.members:
        if not m.live:
            continue
        export_dir = m.run_dir.resolve() / "sae"
        if ctx.rank == m.leader:
            density = m.state.fire_total / max(m.state.samples_total, 1)
            where = {"sweep": job.name, "sweep_point": m.name} if job.sweep is not None else {}
            export_saelens(m.sae, export_dir, density, metadata={"run_name": m.run_dir.name, **where})
        if m.record is None:
            continue
        lm = m.last_metrics
        final = {"final_loss": lm.get("loss"), "final_mse": lm.get("mse"), "final_fvu": lm.get("fvu"),
                 "final_l0": lm.get("l0"), "final_dead_fraction": lm.get("dead_fraction"),
                 "final_samples_per_s": lm.get("samples_per_s"), "recovery_mean_cos": lm.get("recovery_mean_cos"),
                 "recovery_frac": lm.get("recovery_frac")}
        m.record.finish(status="COMPLETED", export_dir=str(export_dir), last_step=step, **final)
        if job.sweep is None:
            final["peak_memory_bytes"] = last_peak  # of the training steps; the last checkpoint and export come after
            final["estimated_memory_bytes"] = estimate.total
            _log_final(step, final, estimate, export_dir)
        if m.name in evaluated:
            record_run_evaluation(m.cfg, m.record, m.run_dir, export_dir, *evaluated[m.name])
    if isinstance(job.record, SweepRecord):
        status, note = _sweep_end(job.members)
        if note and ctx.is_main:
            log.warning("%s", note)
        job.record.finish(status, note)
    D.barrier()
    single = job.sweep is None
    return TrainResult(run_dir=job.run_dir, run_id=job.record.run_id if single else None,
                       export_dir=job.run_dir / "sae" if single and ctx.is_main else None, step=step,
                       final=final if single else {})


def _sweep_end(members: list[Member]) -> tuple[str, str | None]:
    """The sweep row's end: COMPLETED while one SAE at least completed, with how many failed."""
    failed = [m for m in members if not m.live]
    if not failed:
        return "COMPLETED", None
    note = f"{len(failed)} of {len(members)} SAEs failed: " + "; ".join(m.failed for m in failed)
    return ("FAILED" if len(failed) == len(members) else "COMPLETED"), note[:4000]


def _log_start(job: Job, stream: Stream, estimate: MemoryEstimate, latest: Path | None) -> None:
    cfg, ctx, plan = job.cfg, job.ctx, stream.plan
    shares = (f"shares of each micro-batch: {list(plan.shares)}, {plan.micro_steps} micro-batch"
              f"{'es' if plan.micro_steps > 1 else ''} a step ({stream.why})")
    if job.sweep is None:
        fraction, factor = cfg.resolved_refit_fraction, cfg.resolved_decoder_lr_factor  # (0: no refit)
        weight, start, until = cfg.resolved_matryoshka_inner_weight
        log.info("run %s: %s SAE d_in=%d d_sae=%d on %d x %s (%s), global batch %d, lr %.2e%s%s%s%s%s",
                 job.record.run_id if job.record.run_id is not None else "(no db)", cfg.architecture, cfg.d_in,
                 cfg.resolved_d_sae, ctx.world_size, ctx.device.type, ctx.backend, plan.global_batch,
                 cfg.resolved_lr, f" (decoder at {factor:g}x the lr)" if factor != 1 else "",
                 ", bf16 autocast" if use_bf16(cfg, ctx.device) else "",
                 ", inner prefixes through their own offset" if cfg.resolved_matryoshka_inner_offset else "",
                 f", inner weight {start:g} falling to {weight:g} by {until:.0%} of the steps"
                 if start != weight else "",
                 f", decoder refit to the last {fraction:.0%} of the steps" if fraction else "")
        log.info("%s", shares)
        log.info("memory estimate: %s", estimate.describe())
        log.info("run directory: %s", job.run_dir)
        return
    log.info("sweep %s: %d SAEs from one %s stream on %d x %s (%s), global batch %d", job.name, len(job.members),
             cfg.source, ctx.world_size, ctx.device.type, ctx.backend, plan.global_batch)
    log.info("%s", shares)
    if ctx.world_size > 1 and not job.balances:
        log.info("each SAE trains on one device, on the whole global batch whoever read it: the shares change "
                 "no device's work, so they stay equal and are not rebalanced")
    for line in job.placement.lines():
        log.info("%s", line)
    for m in job.members:
        log.info("  %s: %s SAE d_sae=%d, lr %.2e, ranks %s%s", m.name, m.cfg.architecture, m.cfg.resolved_d_sae,
                 m.cfg.resolved_lr, list(m.ranks), f" (failed before: {m.failed})" if m.failed else "")
    if latest is not None:
        log.info("resumed from %s", latest)
    log.info("run directory: %s (each SAE under saes/)", job.run_dir)


def _log_final(step: int, final: dict, estimate: MemoryEstimate, export_dir: Path) -> None:
    log.info("done: step %d, FVU %.4f, L0 %.1f, dead %.1f%%", step, final["final_fvu"] or float("nan"),
             final["final_l0"] or 0.0, 100 * (final["final_dead_fraction"] or 0.0))
    if final["recovery_frac"] is not None:
        log.info("planted features recovered (cos > 0.9): %.1f%%, mean best cosine %.3f",
                 100 * final["recovery_frac"], final["recovery_mean_cos"])
    peak_bytes = final["peak_memory_bytes"]
    if peak_bytes:
        log.info("peak memory: measured %.1f MiB, estimated %.1f MiB (rank 0)",
                 peak_bytes / 2**20, estimate.total / 2**20)
    log.info("SAELens export: %s", export_dir)


def record_run_evaluation(cfg, record: RunRecord, run_dir: Path, export_dir: Path, evaluation, where: str) -> None:
    """evaluation.json beside the export, a row in `evaluations`, and its summary in the log."""
    for line in summary_lines(evaluation, where):
        log.info("%s", line)
    (run_dir / "evaluation.json").write_text(json.dumps({**evaluation.to_dict(), "which_rows": where}, indent=1) + "\n")
    if record.engine is not None:
        from sae_dist.db.evaluations import record_evaluation

        data = cfg.shards_path or cfg.model_path or "synthetic"
        record_evaluation(record.engine, evaluation, export_dir, data, run_id=record.run_id, where="heldout")


# ---- setting up a rank ----


def prepare_run_dir(cfg: TrainConfig) -> tuple[str, str]:
    name, run_dir = check_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return name, str(run_dir.resolve())


def device_label(ctx: D.DistContext) -> str:
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        uuid = getattr(props, "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else f"cuda:{ctx.local_rank}"
    return f"cpu:{ctx.rank}"


def set_threads(ctx: D.DistContext) -> None:
    if ctx.device.type != "cpu":
        return
    # torchrun defaults OMP_NUM_THREADS to 1; CPU ranks share the cores instead.
    per_rank = os.environ.get(THREADS_PER_RANK_ENV)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    torch.set_num_threads(int(per_rank) if per_rank else max(1, (os.cpu_count() or 1) // local_world))


def kill_step_for_tests(rank: int) -> tuple[int, signal.Signals | None] | None:
    """(the step after which this rank acts, the signal it sends itself): SIGKILL from
    $SAE_DIST_TEST_KILL_RANK_AT, SIGTERM from $SAE_DIST_TEST_TERM_RANK_AT, None (it waits until
    a signal reaches it) from $SAE_DIST_TEST_PAUSE_RANK_AT ("rank:step"); None when none names it."""
    for env, sig in ((KILL_RANK_AT_ENV, signal.SIGKILL), (TERM_RANK_AT_ENV, signal.SIGTERM), (PAUSE_RANK_AT_ENV, None)):
        does = f"{sig.name}s itself" if sig else "waits for a signal"
        steps = rank_values(env, os.environ.get(env, "").strip(), int, 1, f"2:15 (rank 2 {does} after step 15)")
        if rank in steps:
            return steps[rank], sig
    return None


def _wait_for_a_signal() -> None:
    while not received_stop:
        time.sleep(0.05)


received_stop: list[int] = []  # signals seen: a peer's error caused by its own stop is a stop too
# While it holds True (the training steps), a signal asks for a stop at the next report, with a
# checkpoint; elsewhere (start, evaluation, export) it stops at once.
deferred_stop: list[bool] = []


@contextmanager
def stop_on_signals():
    """SIGTERM / SIGINT raise TrainingStopped (main thread only), so that rank 0 records why its
    run ended instead of leaving it RUNNING: at once outside the steps, at the next report with a
    checkpoint during them (`deferred_stop`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        # Once: a cancel often signals a rank twice (directly, and via torchrun), and the second
        # must not interrupt the first one's last database write.
        if not received_stop:
            received_stop.append(signum)
            if not deferred_stop:
                raise TrainingStopped(signum)

    received_stop.clear()  # one run's (a process may train more than once: the tests do)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        deferred_stop.clear()

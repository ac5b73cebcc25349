"""The training loop of one rank: DDP over the devices torchrun gave us, rank 0 logs and writes.

Read top to bottom it is the whole story: set up the process group, the data and the model;
start fresh (b_dec from the first batch) or resume from the latest checkpoint; then steps of
forward / backward (DDP all-reduces the gradients) / decoder constraint / Adam; every `log_every`
steps one report all-reduces the window's sums into the metrics and dead-latent counters and
gathers every rank's timings, from which every rank takes the same rebalancing decision;
checkpoints and the final SAELens export are written by rank 0 while the others wait at a
barrier. The pieces: sae_dist.train.state (start, resume, checkpoint), sae_dist.train.window (the
report), sae_dist.train.shares and sae_dist.train.balance (who computes how much of a step),
sae_dist.train.run_record (the database). See docs/architecture.md.
"""

from __future__ import annotations

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
from sae_dist.contract import KILL_RANK_AT_ENV, THREADS_PER_RANK_ENV, rank_values
from sae_dist.data.sources.base import ActivationSource
from sae_dist.data.sources.make import make_source
from sae_dist.errors import TrainingStopped
from sae_dist.evaluate.end_of_run import end_of_run_evaluation, summary_lines
from sae_dist.evaluate.metrics import dictionary_recovery
from sae_dist.memory import MemoryEstimate, PeakMemory, estimate_for_config
from sae_dist.models.export import export_saelens
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.balance import BalanceDecision, BatchPlan, rebalance
from sae_dist.train.checkpoint import check_run_dir
from sae_dist.train.lr import lr_at
from sae_dist.train.run_record import RunRecord
from sae_dist.train.shares import slowdown_for_tests
from sae_dist.train.state import TrainState, on_main, start_or_resume, write_checkpoint
from sae_dist.train.step import autocast_for, make_optimizer, train_step, use_bf16, wrap_ddp
from sae_dist.train.window import MetricsWindow, WindowReport, progress_line

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    run_id: int | None
    export_dir: Path | None
    step: int
    final: dict[str, Any] = field(default_factory=dict)


def train(cfg: TrainConfig) -> TrainResult:
    ctx = D.init_distributed()
    with stop_on_signals():
        result = _train(cfg, ctx)
    # Only a run that ended well tears the process group down: after an error a peer may be
    # gone already, and gloo's teardown then aborts the process (std::terminate).
    D.shutdown()
    return result


def _train(cfg: TrainConfig, ctx: D.DistContext) -> TrainResult:
    set_threads(ctx)
    torch.manual_seed(cfg.seed)
    source = make_source(cfg, ctx)
    # Rule-based defaults become numbers here, so the run's stored config says what it ran with.
    cfg = cfg.with_d_in(source.d_in).resolved(ctx.world_size)

    name, run_dir = on_main(ctx, prepare_run_dir, cfg)
    device_ids = D.gather_objects(device_label(ctx))
    record = RunRecord(cfg, ctx, name, run_dir, device_ids)
    try:
        return _loop(cfg, ctx, source, Path(run_dir), record, device_ids)
    except BaseException as e:
        if isinstance(e, TrainingStopped) or received_stop:
            stop = e if isinstance(e, TrainingStopped) else TrainingStopped(received_stop[0])
            record.finish(status="STOPPED", error=f"stopped by {stop.signame} (a cancel, a time limit or Ctrl-C)")
            raise stop from None

        record.finish(status="FAILED", error=f"{type(e).__name__}: {e}"[:2000])
        raise


def _loop(cfg: TrainConfig, ctx: D.DistContext, source: ActivationSource, run_dir: Path, record: RunRecord,
          device_ids: list[str]) -> TrainResult:
    autocast = autocast_for(cfg, ctx.device)
    peak = PeakMemory(ctx.device)
    peak.reset()
    sae = build_sae(cfg, ctx.device)
    opt = make_optimizer(sae, cfg.resolved_lr)
    slowdown = slowdown_for_tests(ctx.rank)
    kill_at = kill_step_for_tests(ctx.rank)
    state, why, first_batches = start_or_resume(cfg, ctx, sae, opt, source, run_dir, record, device_ids, slowdown)
    model = wrap_ddp(sae, ctx, cfg)
    estimate = estimate_for_config(cfg, ctx.world_size, ctx.device.type)
    if ctx.is_main:
        _log_start(cfg, ctx, record, state.plan, why, estimate, run_dir)
    window = MetricsWindow(cfg.d_in, cfg.resolved_d_sae, ctx.device)
    last_metrics: dict[str, Any] = {}
    last_peak: int | None = None
    limited_reported: int | None = None

    while state.step < cfg.steps:
        state.step += 1
        step = state.step
        at_checkpoint = bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps
        report = at_checkpoint or step % cfg.log_every == 0
        lr = lr_at(step, cfg.resolved_lr, cfg.steps, cfg.lr_warmup_steps, cfg.lr_decay_fraction)
        for group in opt.param_groups:
            group["lr"] = lr

        t0 = time.perf_counter()
        batches = first_batches or source.next_batches(state.plan, ctx.rank, ctx.device)
        first_batches = None
        result = train_step(model, sae, opt, batches, state.dead, autocast,
                            grad_norm=report, loss_scale=state.plan.loss_scale(ctx.rank), slowdown=slowdown)
        window.add(batches, result.outputs)
        window.end_step(t0, result.forward_done - t0)  # compute: data + forward, no collective yet
        if step == kill_at:  # test-only: a device that dies mid-run, for real
            os.kill(os.getpid(), signal.SIGKILL)
        if not report:
            continue

        # ---- one report: a few small collectives for the whole window ----
        w = window.report(step, state, cfg.dead_after_samples, run_dir, peak)
        # Every rank decides from the same gathered numbers and the same state: the same new plan
        # everywhere.
        balance = rebalance(state.plan.shares, w.times, state.balance, allowed=cfg.rebalance and ctx.world_size > 1)
        state.balance = balance.state
        planted = source.planted_features
        recovery = dictionary_recovery(planted, sae.W_dec) if planted is not None and at_checkpoint else None
        last_metrics, last_peak = w.metrics(lr, result.grad_norm, balance.limited_rank, recovery), w.peak_bytes
        if ctx.is_main:
            record.log(last_metrics, step, w.rank_rows(device_ids, state.plan))
            log.info("%s", progress_line(step, cfg.steps, last_metrics, w.stragglers))
        _apply_balance(ctx, state, balance, w, record, limited_reported)
        limited_reported = balance.limited_rank
        if at_checkpoint:
            write_checkpoint(cfg, ctx, sae, opt, source, state, run_dir)
        window.started = time.perf_counter()  # the checkpoint's time is not the next window's

    return _finish(cfg, ctx, sae, source, state, last_metrics, last_peak, estimate, run_dir, record)


def _log_start(cfg: TrainConfig, ctx: D.DistContext, record: RunRecord, plan: BatchPlan, why: str,
               estimate: MemoryEstimate, run_dir: Path) -> None:
    log.info("run %s: %s SAE d_in=%d d_sae=%d on %d x %s (%s), global batch %d, lr %.2e%s",
             record.run_id if record.run_id is not None else "(no db)", cfg.architecture, cfg.d_in,
             cfg.resolved_d_sae, ctx.world_size, ctx.device.type, ctx.backend, plan.global_batch,
             cfg.resolved_lr, ", bf16 autocast" if use_bf16(cfg, ctx.device) else "")
    log.info("shares of each micro-batch: %s, %d micro-batch%s a step (%s)", list(plan.shares),
             plan.micro_steps, "es" if plan.micro_steps > 1 else "", why)
    log.info("memory estimate: %s", estimate.describe())
    log.info("run directory: %s", run_dir)


def _apply_balance(ctx: D.DistContext, state: TrainState, balance: BalanceDecision, w: WindowReport,
                   record: RunRecord, limited_reported: int | None) -> None:
    """The rebalancer's decision takes effect from the next step; rank 0 records a move, and a rank
    that stays slow even at its smallest share (once, until that changes)."""
    if balance.changed(state.plan.shares):
        window_plan = state.plan
        state.plan = BatchPlan(window_plan.global_batch, window_plan.micro_steps, balance.shares)
        if ctx.is_main:
            record.rebalanced(state.step, window_plan, state.plan, w.compute_times, balance)
    if balance.limited_rank is not None and balance.limited_rank != limited_reported and ctx.is_main:
        record.balance_limited(state.step, balance)


def _finish(cfg: TrainConfig, ctx: D.DistContext, sae: SparseAutoencoder, source: ActivationSource,
            state: TrainState, last_metrics: dict, last_peak: int | None, estimate: MemoryEstimate,
            run_dir: Path, record: RunRecord) -> TrainResult:
    """The end: evaluate on rows never trained on, export once, record the final numbers."""
    evaluated = end_of_run_evaluation(cfg, sae, source, ctx, state.plan)
    export_dir = run_dir / "sae"
    final: dict[str, Any] = {}
    if ctx.is_main:
        density = state.fire_total / max(state.samples_total, 1)
        export_saelens(sae, export_dir, density, metadata={"run_name": run_dir.name})
        final = {
            "final_loss": last_metrics.get("loss"), "final_mse": last_metrics.get("mse"),
            "final_fvu": last_metrics.get("fvu"), "final_l0": last_metrics.get("l0"),
            "final_dead_fraction": last_metrics.get("dead_fraction"),
            "final_samples_per_s": last_metrics.get("samples_per_s"),
            "recovery_mean_cos": last_metrics.get("recovery_mean_cos"),
            "recovery_frac": last_metrics.get("recovery_frac"),
        }
        record.finish(status="COMPLETED", export_dir=str(export_dir), last_step=state.step, **final)
        final["peak_memory_bytes"] = last_peak  # of the training steps; the last checkpoint and export come after
        final["estimated_memory_bytes"] = estimate.total
        _log_final(state.step, final, estimate, export_dir)
        if evaluated is not None:
            record_run_evaluation(cfg, record, run_dir, export_dir, *evaluated)
    D.barrier()
    return TrainResult(run_dir=run_dir, run_id=record.run_id, export_dir=export_dir if ctx.is_main else None,
                       step=state.step, final=final)


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


def build_sae(cfg: TrainConfig, device) -> SparseAutoencoder:
    """The SAE a config describes (d_in already resolved from the source)."""
    return SparseAutoencoder(
        cfg.d_in, cfg.resolved_d_sae, cfg.architecture, cfg.k, l1_coefficient=cfg.l1_coefficient,
        l0_coefficient=cfg.l0_coefficient, auxk_coefficient=cfg.auxk_coefficient,
        auxk_k=cfg.resolved_auxk_k, jumprelu_init_threshold=cfg.jumprelu_init_threshold,
        jumprelu_bandwidth=cfg.jumprelu_bandwidth, seed=cfg.seed, device=device)


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


def kill_step_for_tests(rank: int) -> int | None:
    """The step after which this rank SIGKILLs itself, from $SAE_DIST_TEST_KILL_RANK_AT
    ("rank:step"); None when unset or naming another rank."""
    steps = rank_values(KILL_RANK_AT_ENV, os.environ.get(KILL_RANK_AT_ENV, "").strip(), int, 1,
                        "2:15 (rank 2 SIGKILLs itself after step 15)")
    return steps.get(rank)


received_stop: list[int] = []  # signals seen: a peer's error caused by its own stop is a stop too


@contextmanager
def stop_on_signals():
    """SIGTERM / SIGINT raise TrainingStopped in the training loop (main thread only), so that
    rank 0 records why its run ended instead of leaving it RUNNING."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        # Once: a cancel often signals a rank twice (directly, and via torchrun), and the second
        # must not interrupt the first one's last database write.
        if not received_stop:
            received_stop.append(signum)
            raise TrainingStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

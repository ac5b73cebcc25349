"""The training loop of one rank: DDP over the devices torchrun gave us, rank 0 logs and writes.

Read top to bottom it is the whole story: set up the process group, the data and the model;
resume or initialise b_dec from the first batch; then steps of forward / backward / decoder
constraint / Adam; every `log_every` steps one all-reduce of the accumulated sums gives the
metrics, dead-latent counters and per-rank timings; checkpoints and the final SAELens export are
written by rank 0 while the others wait at a barrier.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import signal
import statistics
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from sae_dist import distributed as D
from sae_dist.balance import (BalanceDecision, BalanceState, BatchPlan, WindowTimes, bounded_split, imbalance,
                              initial_weights, plan_for, rebalance)
from sae_dist.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from sae_dist.config import SYNTHETIC_D_IN, TrainConfig
from sae_dist.defaults import heldout_rows_of
from sae_dist.errors import TrainingStopped, UserError
from sae_dist.evaluate.end_of_run import end_of_run_evaluation, summary_lines
from sae_dist.export import export_saelens
from sae_dist.lr import lr_at
from sae_dist.memory import PeakMemory, estimate_for_config
from sae_dist.metrics import IDX, SUMS, find_stragglers, window_metrics
from sae_dist.sae import SparseAutoencoder
from sae_dist.sources.synthetic import SyntheticSource, dictionary_recovery
from sae_dist.step import autocast_for, make_optimizer, train_step, use_bf16, wrap_ddp

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """NaN or inf in the data or the loss; the last good checkpoint is left as it was."""

    shared = True  # seen in all-reduced sums, so on every rank at once


@dataclass
class TrainResult:
    run_dir: Path
    run_id: int | None
    export_dir: Path | None
    step: int
    final: dict[str, Any] = field(default_factory=dict)


def make_source(cfg: TrainConfig, ctx: D.DistContext):
    if cfg.source == "synthetic":
        return SyntheticSource(
            d_in=cfg.d_in or SYNTHETIC_D_IN, n_features=cfg.synthetic_features, active=cfg.synthetic_active,
            power_law=cfg.synthetic_power_law, noise=cfg.synthetic_noise, seed=cfg.seed,
            rank=ctx.rank, world_size=ctx.world_size, batch_size=cfg.batch_size)
    if cfg.source == "model":
        from sae_dist.sources.model import ModelSource  # imports transformers: only model runs need it

        return ModelSource(cfg.model_path, cfg.model_layer, cfg.model_site, cfg.text_path, cfg.context_length,
                           cfg.batch_size, cfg.seed, ctx.rank, ctx.world_size, ctx.device,
                           global_batch=cfg.batch_size * ctx.world_size * cfg.grad_accum)
    from sae_dist.sources.shards import ShardStream, open_shards  # only shard runs need it

    # One stream over all the data, the same on every rank; each reads its slice of a step.
    dataset = open_shards(cfg.shards_path)
    return ShardStream(dataset, rank=0, world_size=1, batch_size=cfg.batch_size * ctx.world_size * cfg.grad_accum,
                       seed=cfg.seed, holdout_rows=heldout_rows_of(cfg.eval_rows, dataset.total_rows))


def source_d_in(source) -> int:
    return source.d_in if hasattr(source, "d_in") else source.dataset.d_in


def safe_name(name: str) -> str:
    """A run name as one harmless path component (names are stored literally elsewhere)."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "run"
    return clean[:120]


def _on_main(ctx: D.DistContext, fn, *args):
    """Run fn on rank 0 and hand its result (or its UserError) to every rank."""
    result: tuple[str, Any] = ("ok", None)
    if ctx.is_main:
        try:
            result = ("ok", fn(*args))
        except UserError as e:
            result = ("error", str(e))
    result = D.broadcast_object(result)
    if result[0] == "error":
        error = UserError(result[1])
        error.shared = True
        raise error
    return result[1]


def check_run_dir(cfg: TrainConfig) -> tuple[str, Path]:
    """(run name, run directory) for a config; a UserError when the directory does not fit."""
    from sae_dist.paths import state_home

    name = cfg.name or f"{cfg.architecture}-{cfg.resolved_d_sae}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(cfg.out_dir).expanduser() if cfg.out_dir else state_home() / "runs" / safe_name(name)
    if cfg.resume:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise UserError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; "
                            f"start without --resume or point --out-dir at the run to continue")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run directory {run_dir} already exists and is not empty; "
                        f"use --resume to continue it or choose another --out-dir / --name")
    return name, run_dir


def _prepare_run_dir(cfg: TrainConfig) -> tuple[str, str]:
    name, run_dir = check_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    return name, str(run_dir.resolve())


class _RunRecord:
    """Rank 0's link to the state database (or nothing, with --no-db)."""

    def __init__(self, cfg: TrainConfig, ctx: D.DistContext, name: str, run_dir: str, device_ids: list[str]):
        self.engine = self.writer = None
        self.run_id: int | None = None
        if not (cfg.db and ctx.is_main):
            return
        from sae_dist.db import DatabaseMetricsLogger, create_run, delete_metrics_after, find_run_by_dir, get_engine

        self.engine = get_engine()
        existing = find_run_by_dir(self.engine, run_dir) if cfg.resume else None
        if existing is not None:
            self.run_id = existing.id
        else:
            now = datetime.now(timezone.utc)
            self.run_id = create_run(
                self.engine, name=name, status="RUNNING", architecture=cfg.architecture,
                config_json=json.dumps(cfg.to_dict()), world_size=ctx.world_size, backend=ctx.backend,
                device_ids=json.dumps(device_ids), host=socket.gethostname(), run_dir=run_dir,
                total_steps=cfg.steps, job_id=_job_id(), created_at=now, started_at=now)
        self._delete_after = delete_metrics_after
        self.writer = DatabaseMetricsLogger(self.engine, self.run_id)

    def resumed_at(self, step: int, world_size: int, device_ids: list[str]) -> None:
        if self.engine is not None:
            # Rows logged after the checkpoint by the interrupted run are replaced by the new ones.
            self._delete_after(self.engine, self.run_id, step)
            self.writer.update_run(status="RUNNING", error=None, finished_at=None, world_size=world_size,
                                   device_ids=json.dumps(device_ids))

    def event(self, step: int, kind: str, message: str, details: dict) -> None:
        if self.writer is not None:
            self.writer.log_event(step, kind, message, details)

    def restart_event(self, step: int, plan: BatchPlan) -> None:
        """Our launcher restarted the ranks without a device that failed: say so beside the curves."""
        note = os.environ.get(RESTART_NOTE_ENV)
        if not note:
            return
        details = {**json.loads(note), "resumed_from_step": step, "world_size_after": plan.world_size,
                   "grad_accum": plan.micro_steps, "global_batch": plan.global_batch, "shares": list(plan.shares)}
        message = (f"rank {', '.join(map(str, details.get('lost_ranks', [])))} lost "
                   f"({details.get('reason', 'failed')}); continued from step {step} on {plan.world_size} "
                   f"devices, global batch {plan.global_batch} in {plan.micro_steps} micro-batches")
        log.warning("%s", message)
        self.event(step, "degraded", message, details)

    def rebalanced(self, step: int, before: BatchPlan, after: BatchPlan, times: list[float],
                   decision: BalanceDecision) -> None:
        """`times`: the window's median compute times per rank; `decision` holds the figures of
        the windows that passed the rule."""
        message = f"shares {list(before.shares)} -> {list(after.shares)}: {decision.describe()}"
        log.info("rebalanced %s", message)
        self.event(step, "rebalance", f"rebalanced {message}",
                   {"before": list(before.shares), "after": list(after.shares), "compute_time_s": times,
                    "imbalance": imbalance(times), "slow_rank": decision.slow_rank,
                    "threshold": decision.threshold, "moves": decision.state.moves if decision.state else None,
                    "evidence": [{"slow_low_s": lo, "fastest_high_s": hi, "ratio": r}
                                 for lo, hi, r in decision.evidence]})

    def balance_limited(self, step: int, decision) -> None:
        message = (f"rank {decision.limited_rank} stays {decision.predicted_imbalance:.1f}x slower than the "
                   f"fastest even at its smallest share: rebalancing cannot even it out")
        log.warning("%s", message)
        self.event(step, "balance_limited", message,
                   {"rank": decision.limited_rank, "slowdown": decision.predicted_imbalance})

    def log(self, metrics: dict, step: int, rank_rows: list[dict]) -> None:
        if self.writer is not None:
            self.writer.log(metrics, step)
            self.writer.log_rank_stats(step, rank_rows)
            self.writer.update_run(last_step=step)

    def finish(self, **fields) -> None:
        if self.writer is not None:
            self.writer.update_run(finished_at=datetime.now(timezone.utc), **fields)
            self.writer.close()


def _job_id() -> int | None:
    value = os.environ.get("SAE_DIST_JOB_ID")
    return int(value) if value and value.isdigit() else None


def _device_label(ctx: D.DistContext) -> str:
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        uuid = getattr(props, "uuid", None)
        return f"GPU-{uuid}" if uuid is not None else f"cuda:{ctx.local_rank}"
    return f"cpu:{ctx.rank}"


def set_threads(ctx: D.DistContext) -> None:
    if ctx.device.type != "cpu":
        return
    # torchrun defaults OMP_NUM_THREADS to 1; CPU ranks share the cores instead.
    per_rank = os.environ.get("SAE_DIST_THREADS_PER_RANK")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    torch.set_num_threads(int(per_rank) if per_rank else max(1, (os.cpu_count() or 1) // local_world))


_received_stop: list[int] = []  # signals seen: a peer's error caused by its own stop is a stop too


@contextmanager
def _stop_on_signals():
    """SIGTERM / SIGINT raise TrainingStopped in the training loop (main thread only), so that
    rank 0 records why its run ended instead of leaving it RUNNING."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        # Once: a cancel often signals a rank twice (directly, and via torchrun), and the second
        # must not interrupt the first one's last database write.
        if not _received_stop:
            _received_stop.append(signum)
            raise TrainingStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- how a step's samples are shared (decisions in sae_dist.balance) ----

SLOW_RANKS_ENV = "SAE_DIST_TEST_SLOW_RANKS"  # test-only: "1:3" makes rank 1's compute 3x slower
RESTART_NOTE_ENV = "SAE_DIST_RESTART_NOTE"  # set by our launcher when it restarts without a device
SPEED_PROBES = 3


def slowdown_for_tests(rank: int) -> float:
    """This rank's factor from $SAE_DIST_TEST_SLOW_RANKS ("rank:factor,..."), 1.0 when unset: a
    stand-in for a slower card on virtual devices."""
    raw = os.environ.get(SLOW_RANKS_ENV, "").strip()
    factors = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        r, _, f = item.partition(":")
        try:
            factors[int(r)] = float(f)
        except ValueError:
            raise UserError(f"{SLOW_RANKS_ENV}={raw!r}: give rank:factor pairs such as 1:3") from None
        if not factors[int(r)] >= 1.0:
            raise UserError(f"{SLOW_RANKS_ENV}={raw!r}: a factor is at least 1 (1 = normal speed)")
    return factors.get(rank, 1.0)


def first_plan(cfg: TrainConfig, ctx: D.DistContext, sae, slowdown: float) -> tuple[BatchPlan, str]:
    micro = cfg.batch_size * ctx.world_size
    weights, why = _balance_weights(cfg, ctx, sae, cfg.batch_size, slowdown)
    return BatchPlan(micro * cfg.grad_accum, cfg.grad_accum, bounded_split(micro, weights)), why


def resumed_plan(cfg: TrainConfig, ctx: D.DistContext, saved: dict | None, saved_world: int, sae,
                 slowdown: float) -> tuple[BatchPlan, str]:
    """The plan of a resumed run: the checkpoint's (shares included) on as many ranks; on another
    number of ranks its global batch, in as many micro-batches as keep each rank's batch at most
    the configured one, so the training curve goes on as it was."""
    world = ctx.world_size
    if saved_world == world or not saved_world:
        plan = BatchPlan.from_dict(saved) if saved else None
        if plan and plan.world_size == world and plan.micro_steps == cfg.grad_accum and \
                plan.global_batch == cfg.batch_size * world * cfg.grad_accum:
            return plan, "the checkpoint's shares"
        return first_plan(cfg, ctx, sae, slowdown)  # the batch settings were changed on resume
    global_batch = int(saved["global_batch"]) if saved else cfg.batch_size * saved_world * cfg.grad_accum
    micro_steps, micro = plan_for(global_batch, world, cfg.batch_size)
    weights, why = _balance_weights(cfg, ctx, sae, max(1, micro // world), slowdown)
    return (BatchPlan(global_batch, micro_steps, bounded_split(micro, weights)),
            f"global batch {global_batch} kept as {micro_steps} micro-batches of {micro}; shares {why}")


def _balance_weights(cfg: TrainConfig, ctx: D.DistContext, sae, rows: int, slowdown: float) -> tuple[list[float], str]:
    world = ctx.world_size
    if world == 1 or cfg.balance == "equal":
        return [1.0] * world, "equal"
    free = D.gather_objects(_free_memory(ctx.device)) if cfg.balance == "memory" else [None] * world
    speed = D.gather_objects(_measure_speed(sae, ctx.device, rows, slowdown)) if cfg.balance == "speed" else [None] * world
    return initial_weights(cfg.balance, free, speed)


def _free_memory(device: torch.device) -> int | None:
    """Free bytes on a GPU; None for CPU ranks, which share one memory (no share of it is theirs)."""
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None


def _measure_speed(sae: SparseAutoencoder, device: torch.device, rows: int, slowdown: float) -> float | None:
    """Samples per second of forward + backward on this rank, on random rows; the weights, their
    gradients and the buffers are left as they were."""
    buffers = {name: b.clone() for name, b in sae.named_buffers()}
    x = torch.randn(rows, sae.d_in, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(SPEED_PROBES):
        t0 = time.perf_counter()
        sae(x).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        time.sleep(elapsed * (slowdown - 1))
        times.append(elapsed * slowdown)
    sae.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, b in sae.named_buffers():
            b.copy_(buffers[name])
    median = statistics.median(times)
    return rows / median if median > 0 else None


def _load_data_state(source, states: list[dict], plan: BatchPlan) -> None:
    # Every source is one stream shared by every rank (a step's samples never depend on the shares
    # or the number of ranks): one position, whoever wrote it.
    if hasattr(source, "use_global_batch"):
        source.use_global_batch(plan.global_batch)
    source.load_state_dict(states[0])


def build_sae(cfg: TrainConfig, device) -> SparseAutoencoder:
    """The SAE a config describes (d_in already resolved from the source)."""
    return SparseAutoencoder(
        cfg.d_in, cfg.resolved_d_sae, cfg.architecture, cfg.k, l1_coefficient=cfg.l1_coefficient,
        l0_coefficient=cfg.l0_coefficient, auxk_coefficient=cfg.auxk_coefficient,
        auxk_k=cfg.resolved_auxk_k, jumprelu_init_threshold=cfg.jumprelu_init_threshold,
        jumprelu_bandwidth=cfg.jumprelu_bandwidth, seed=cfg.seed, device=device)


def train(cfg: TrainConfig) -> TrainResult:
    ctx = D.init_distributed()
    with _stop_on_signals():
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
    cfg = cfg.with_d_in(source_d_in(source)).resolved(ctx.world_size)
    d_sae = cfg.resolved_d_sae
    bf16 = use_bf16(cfg, ctx.device)
    autocast = autocast_for(cfg, ctx.device)

    name, run_dir = _on_main(ctx, _prepare_run_dir, cfg)
    device_ids = D.gather_objects(_device_label(ctx))
    record = _RunRecord(cfg, ctx, name, run_dir, device_ids)
    try:
        return _loop(cfg, ctx, source, d_sae, autocast, bf16, Path(run_dir), record, device_ids)
    except BaseException as e:
        if isinstance(e, TrainingStopped) or _received_stop:
            stop = e if isinstance(e, TrainingStopped) else TrainingStopped(_received_stop[0])
            record.finish(status="STOPPED", error=f"stopped by {stop.signame} (a cancel, a time limit or Ctrl-C)")
            raise stop from None

        record.finish(status="FAILED", error=f"{type(e).__name__}: {e}"[:2000])
        raise


def _loop(cfg, ctx, source, d_sae, autocast, use_bf16, run_dir: Path, record: _RunRecord, device_ids) -> TrainResult:
    main = ctx.is_main
    peak = PeakMemory(ctx.device)
    peak.reset()
    sae = build_sae(cfg, ctx.device)
    opt = make_optimizer(sae, cfg.resolved_lr)

    # Dead-latent bookkeeping is global (all-reduced), so it is identical on every rank.
    since_fired = torch.zeros(d_sae, dtype=torch.float64, device=ctx.device)
    fire_total = torch.zeros(d_sae, dtype=torch.float64, device=ctx.device)
    samples_total = 0
    step = 0
    first_batches: list[torch.Tensor] | None = None
    slowdown = slowdown_for_tests(ctx.rank)

    latest = latest_checkpoint(run_dir) if cfg.resume else None
    if latest is not None:
        loaded = _on_main(ctx, load_checkpoint, latest)  # read once, broadcast to every rank
        weights, state, meta = loaded
        saved_world = int(meta.get("world_size") or 0)
        sae.load_state_dict(weights)
        opt.load_state_dict(state["optimizer"])
        plan, why = resumed_plan(cfg, ctx, state.get("plan"), saved_world, sae, slowdown)
        # The rebalancer goes on with its streaks, last move and moves so far; on new shares (other
        # ranks, other batch settings) its streaks start again.
        saved_balance = state.get("balance") or {}
        balance_state = (BalanceState.from_dict(saved_balance, ctx.world_size) if plan.to_dict() == state.get("plan")
                         else BalanceState.fresh(ctx.world_size, int(saved_balance.get("moves", 0))))
        _load_data_state(source, state["data"], plan)
        since_fired.copy_(state["since_fired"])
        fire_total.copy_(state["fire_total"])
        samples_total, step = int(state["samples_total"]), int(state["step"])
        torch.set_rng_state(state["rng_cpu"])
        record.resumed_at(step, ctx.world_size, device_ids)
        if main:
            log.info("resumed from %s at step %d%s", latest, step,
                     f" ({saved_world} ranks then, {ctx.world_size} now: {why})" if saved_world != ctx.world_size else "")
            record.restart_event(step, plan)
    else:
        plan, why = first_plan(cfg, ctx, sae, slowdown)
        balance_state = BalanceState.fresh(ctx.world_size)
        # b_dec starts at the data mean (all-reduced), so the first latents explain variation,
        # not the offset. The batch is then trained on like any other.
        first_batches = source.next_batches(plan, ctx.rank, ctx.device)
        with torch.no_grad():
            local = torch.cat(first_batches)
            total = D.all_reduce_sum(torch.cat([local.sum(0), local.new_tensor([len(local)])]))
            sae.b_dec.copy_(total[:-1] / total[-1])

    model = wrap_ddp(sae, ctx, cfg)

    true_features = source.dictionary if isinstance(source, SyntheticSource) else None
    estimate = estimate_for_config(cfg, ctx.world_size, ctx.device.type)
    if main:
        log.info("run %s: %s SAE d_in=%d d_sae=%d on %d x %s (%s), global batch %d, lr %.2e%s",
                 record.run_id if record.run_id is not None else "(no db)", cfg.architecture, cfg.d_in,
                 d_sae, ctx.world_size, ctx.device.type, ctx.backend, plan.global_batch,
                 cfg.resolved_lr, ", bf16 autocast" if use_bf16 else "")
        log.info("shares of each micro-batch: %s, %d micro-batch%s a step (%s)", list(plan.shares),
                 plan.micro_steps, "es" if plan.micro_steps > 1 else "", why)
        log.info("memory estimate: %s", estimate.describe())
        log.info("run directory: %s", run_dir)

    acc = torch.zeros(len(SUMS) + cfg.d_in, dtype=torch.float64, device=ctx.device)
    dead_mask = since_fired >= cfg.dead_after_samples
    any_dead = bool(dead_mask.any())  # refreshed at reports: no device sync per step
    fired_window = torch.zeros(d_sae, dtype=torch.float64, device=ctx.device)
    step_times: list[float] = []
    compute_times: list[float] = []
    window_start = time.perf_counter()
    final: dict[str, Any] = {}
    last_metrics: dict[str, Any] = {}
    step_peak: int | None = None
    limited_reported: int | None = None

    while step < cfg.steps:
        step += 1
        report = step % cfg.log_every == 0 or step == cfg.steps or (
            cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        lr = lr_at(step, cfg.resolved_lr, cfg.steps, cfg.lr_warmup_steps, cfg.lr_decay_fraction)
        for group in opt.param_groups:
            group["lr"] = lr

        t0 = time.perf_counter()
        batches = first_batches or source.next_batches(plan, ctx.rank, ctx.device)
        first_batches = None
        result = train_step(model, sae, opt, batches, dead_mask if any_dead else None, autocast,
                            grad_norm=report, loss_scale=plan.loss_scale(ctx.rank), slowdown=slowdown)
        t_compute = result.forward_done - t0  # data + forward: no collective involved yet

        with torch.no_grad():
            for x, out in zip(batches, result.outputs):
                b = x.shape[0]
                flat = x.reshape(-1)
                x_sq = torch.dot(flat, flat).double()  # not finite when x has a NaN or an inf
                acc[IDX["loss"]] += out.loss.detach().double() * b
                acc[IDX["mse"]] += out.mse.detach().double() * b
                acc[IDX["x_sq"]] += x_sq
                acc[IDX["l0"]] += out.l0.detach().double() * b
                acc[IDX["auxk"]] += out.auxk_loss.detach().double() * b
                acc[IDX["sparsity"]] += out.sparsity_loss.detach().double() * b
                acc[IDX["samples"]] += b
                acc[IDX["bad_data"]] += (~torch.isfinite(x_sq)).double()
                acc[IDX["bad_loss"]] += (~torch.isfinite(out.loss.detach())).double()
                acc[len(SUMS):] += x.sum(0, dtype=torch.float64)
                fired_window += out.fired.detach().double()
        grad_norm = result.grad_norm
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        step_times.append(time.perf_counter() - t0)
        compute_times.append(t_compute)

        if not report:
            continue
        # ---- one report: a few small collectives for the whole window ----
        D.all_reduce_sum(acc)
        D.all_reduce_sum(fired_window)
        m = window_metrics(acc)
        if m.bad_data or m.bad_loss:
            what = "the input activations" if m.bad_data else "the loss"
            ckpt = latest_checkpoint(run_dir)
            raise TrainingDiverged(
                f"NaN or inf in {what} between steps {step - len(step_times) + 1} and {step}; stopped. "
                + (f"The last good checkpoint {ckpt} is intact." if ckpt else "No checkpoint was written yet.")
                + ("" if m.bad_data else " Try a lower --lr."))
        samples_total += m.samples
        fire_total += fired_window
        since_fired = torch.where(fired_window > 0, torch.zeros_like(since_fired), since_fired + m.samples)
        dead_mask = since_fired >= cfg.dead_after_samples
        any_dead = bool(dead_mask.any())
        elapsed = time.perf_counter() - window_start
        step_peak = peak.peak_bytes()  # read before this report's checkpoint adds its own copies
        # Medians and quartiles: the first step after a start carries one-time costs that are not
        # speed, and a busy neighbour on a shared machine makes single steps slow.
        quartiles = WindowTimes.of(compute_times)
        rank_row = torch.tensor([statistics.median(step_times), quartiles.median, float(step_peak or 0),
                                 *quartiles.row()], dtype=torch.float64, device=ctx.device)
        gathered = D.all_gather_rows(rank_row).cpu().tolist()
        per_rank = [r[:3] for r in gathered]
        window_times = [r[1] for r in per_rank]
        stragglers = find_stragglers(window_times)
        window_plan = plan
        # Every rank decides from the same gathered numbers and the same state: the same new plan
        # everywhere.
        balance = rebalance(plan.shares, [WindowTimes.from_row(r[3:]) for r in gathered], balance_state,
                            allowed=cfg.rebalance and ctx.world_size > 1)
        balance_state = balance.state
        recovery = None
        if true_features is not None and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            recovery = dictionary_recovery(true_features, sae.W_dec)

        last_metrics = {
            "samples_seen": samples_total, "loss": m.loss, "mse": m.mse, "fvu": m.fvu,
            "explained_variance": m.explained_variance, "l0": m.l0,
            "dead_fraction": float(dead_mask.double().mean()), "auxk_loss": m.auxk_loss, "lr": lr,
            "grad_norm": grad_norm, "samples_per_s": m.samples / elapsed if elapsed > 0 else None,
            "straggler_rank": stragglers[0] if stragglers else None,
            "imbalance": imbalance(window_times), "balance_limited_rank": balance.limited_rank,
            "recovery_mean_cos": recovery[0] if recovery else None,
            "recovery_frac": recovery[1] if recovery else None,
        }
        if main:
            rank_rows = [{"rank": r, "device": device_ids[r], "step_time_s": t, "compute_time_s": c,
                          "peak_memory_bytes": int(p) if p else None, "is_straggler": r in stragglers,
                          "batch_size": window_plan.per_step(r)}
                         for r, (t, c, p) in enumerate(per_rank)]
            record.log(last_metrics, step, rank_rows)
            log.info("%s", _format_line(step, cfg.steps, last_metrics, stragglers))
        if balance.changed(plan.shares):
            plan = BatchPlan(plan.global_batch, plan.micro_steps, balance.shares)
            if main:
                record.rebalanced(step, window_plan, plan, window_times, balance)
        if balance.limited_rank is not None and balance.limited_rank != limited_reported and main:
            record.balance_limited(step, balance)
        limited_reported = balance.limited_rank
        acc.zero_()
        fired_window.zero_()
        step_times.clear()
        compute_times.clear()

        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _checkpoint(cfg, ctx, sae, opt, source, since_fired, fire_total, samples_total, step, run_dir, plan,
                        balance_state)
        window_start = time.perf_counter()

    # ---- the end: evaluate on rows never trained on, export once, record the final numbers ----
    evaluated = end_of_run_evaluation(cfg, sae, source, ctx, plan)
    export_dir = run_dir / "sae"
    if main:
        density = fire_total / max(samples_total, 1)
        export_saelens(sae, export_dir, density, metadata={"run_name": run_dir.name})
        peak_bytes = step_peak  # of the training steps; the last checkpoint and export come after
        final = {
            "final_loss": last_metrics.get("loss"), "final_mse": last_metrics.get("mse"),
            "final_fvu": last_metrics.get("fvu"), "final_l0": last_metrics.get("l0"),
            "final_dead_fraction": last_metrics.get("dead_fraction"),
            "final_samples_per_s": last_metrics.get("samples_per_s"),
            "recovery_mean_cos": last_metrics.get("recovery_mean_cos"),
            "recovery_frac": last_metrics.get("recovery_frac"),
        }
        record.finish(status="COMPLETED", export_dir=str(export_dir), last_step=step, **final)
        final["peak_memory_bytes"] = peak_bytes
        final["estimated_memory_bytes"] = estimate.total
        log.info("done: step %d, FVU %.4f, L0 %.1f, dead %.1f%%", step, final["final_fvu"] or float("nan"),
                 final["final_l0"] or 0.0, 100 * (final["final_dead_fraction"] or 0.0))
        if final["recovery_frac"] is not None:
            log.info("planted features recovered (cos > 0.9): %.1f%%, mean best cosine %.3f",
                     100 * final["recovery_frac"], final["recovery_mean_cos"])
        if peak_bytes:
            log.info("peak memory: measured %.1f MiB, estimated %.1f MiB (rank 0)",
                     peak_bytes / 2**20, estimate.total / 2**20)
        log.info("SAELens export: %s", export_dir)
        if evaluated is not None:
            _record_evaluation(cfg, record, run_dir, export_dir, *evaluated)
    D.barrier()
    return TrainResult(run_dir=run_dir, run_id=record.run_id, export_dir=export_dir if main else None,
                       step=step, final=final)


def _record_evaluation(cfg, record: _RunRecord, run_dir: Path, export_dir: Path, evaluation, where: str) -> None:
    """evaluation.json beside the export, a row in `evaluations`, and its summary in the log."""
    for line in summary_lines(evaluation, where):
        log.info("%s", line)
    (run_dir / "evaluation.json").write_text(json.dumps({**evaluation.to_dict(), "which_rows": where}, indent=1) + "\n")
    if record.engine is not None:
        from sae_dist.db.evaluations import record_evaluation

        data = cfg.shards_path or cfg.model_path or "synthetic"
        record_evaluation(record.engine, evaluation, export_dir, data, run_id=record.run_id, where="heldout")


def _checkpoint(cfg, ctx, sae, opt, source, since_fired, fire_total, samples_total, step, run_dir, plan,
                balance_state: BalanceState) -> None:
    data_states = D.gather_objects(source.state_dict())
    if ctx.is_main:
        weights = {k: v for k, v in sae.state_dict().items()}
        state = {
            "optimizer": opt.state_dict(), "step": step, "samples_total": samples_total,
            "data": data_states, "since_fired": since_fired.cpu(), "fire_total": fire_total.cpu(),
            "rng_cpu": torch.get_rng_state(), "plan": plan.to_dict(), "balance": balance_state.to_dict(),
        }
        meta = {"world_size": ctx.world_size, "config": cfg.to_dict(), "saved_at": datetime.now(timezone.utc).isoformat()}
        path = save_checkpoint(run_dir, step, weights, state, meta, keep=cfg.keep_checkpoints)
        log.info("checkpoint: %s", path)
    D.barrier()


def _format_line(step: int, total: int, m: dict, stragglers: list[int]) -> str:
    line = (f"step {step:>6}/{total} | loss {m['loss']:.4f} | fvu {m['fvu']:.4f} | L0 {m['l0']:.1f} | "
            f"dead {100 * m['dead_fraction']:.1f}% | {m['samples_per_s'] or 0:,.0f} samples/s")
    if m.get("recovery_frac") is not None:
        line += f" | recovered {100 * m['recovery_frac']:.0f}%"
    if stragglers:
        line += f" | straggler: rank {', '.join(map(str, stragglers))}"
    return line


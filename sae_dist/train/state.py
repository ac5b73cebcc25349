"""Where a run is, how it starts, and what its checkpoints hold.

A fresh run takes its first shares (`first_stream`); a resumed one reads its latest checkpoint
once on rank 0 and broadcasts it: every SAE's weights, optimizer and dead-latent counters, the
data stream's position, the CPU RNG and the shares of a step. `write_checkpoint` saves exactly
what `resume` reads back, so a resumed run continues with the batches the uninterrupted run would
have had. A single run's checkpoint is one file; a sweep's SAEs each keep theirs in their own
folder beside the run's (which then holds the stream and every SAE's counters).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.data.sources.base import ActivationSource
from sae_dist.errors import UserError
from sae_dist.train import rare_bias, refit
from sae_dist.train.balance import BalanceState, BatchPlan
from sae_dist.train.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from sae_dist.train.shares import first_plan, resumed_plan
from sae_dist.train.step import load_optimizer, optimizer_for

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """How each step's global batch is shared among the ranks, and the rebalancer's memory: one
    per job, whatever the number of SAEs (the same on every rank)."""

    plan: BatchPlan
    balance: BalanceState
    why: str  # why the shares are what they are (a line for the log)


@dataclass
class TrainState:
    """An SAE's position besides its weights and optimizer; the same on every rank (the counters
    are updated from all-reduced sums). The stream's shares and the rebalancer's memory are the
    job's (Stream)."""

    step: int
    samples_total: int
    since_fired: Tensor  # samples since each latent last fired
    fire_total: Tensor  # times each latent fired: the export's feature density
    plan: BatchPlan  # how the SAE's group shares each global micro-batch
    dead: Tensor | None = None  # latents dead long enough for AuxK; None when none are
    # Firings since the last dead-set check, all-reduced when a checkpoint was written between two
    # checks (so a resume, or a stop's checkpoint, moves the dead set at the same steps as a run
    # that never stopped); None: none parked.
    parked_fired: Tensor | None = None
    # The rare-latent bias (sae_dist.train.rare_bias): its rule (None: no bias), and while it is on,
    # each latent's bias and firing-rate average; both None once it is gone.
    rare: rare_bias.RareBiasRule | None = None
    selection_bias: Tensor | None = None
    fire_rate: Tensor | None = None

    def start_rare_bias(self, rule: rare_bias.RareBiasRule | None, k: int) -> None:
        """No bias yet, every latent's rate average at the average rate k / d_sae."""
        self.rare = rule
        if rule is not None:
            d_sae = self.since_fired.numel()
            self.selection_bias = torch.zeros(d_sae, device=self.since_fired.device)
            self.fire_rate = torch.full((d_sae,), k / d_sae, dtype=torch.float64, device=self.since_fired.device)

    def move_rare_bias(self, step: int, fired: Tensor, rows: int, chosen: Tensor, steps: int) -> None:
        """The bias after `steps` steps of `rows` rows ending at `step` (`chosen`: the chosen
        activations' sum and count); gone for good from the rule's stop step."""
        if self.selection_bias is None or self.rare is None:
            return
        if step >= self.rare.stop_step:
            self.selection_bias = self.fire_rate = None
            return
        act_mean = chosen[0] / chosen[1].clamp_min(1)
        self.selection_bias, self.fire_rate = rare_bias.moved(self.selection_bias, self.fire_rate, fired, rows,
                                                              act_mean, steps, self.rare)

    def refresh_dead(self, dead_after_samples: int) -> Tensor:
        """The dead mask; kept as None when no latent is dead (read at checks and reports only: no
        device sync per step)."""
        mask = self.since_fired >= dead_after_samples
        self.dead = mask if bool(mask.any()) else None
        return mask

    def latents_fired(self, fired: Tensor, samples: int, dead_after_samples: int) -> Tensor:
        """A window of `samples` samples in which latent i fired fired[i] times; the dead mask."""
        self.since_fired = torch.where(fired > 0, torch.zeros_like(self.since_fired), self.since_fired + samples)
        return self.refresh_dead(dead_after_samples)


def on_main(ctx: D.DistContext, fn, *args):
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


def first_stream(cfg: TrainConfig, ctx: D.DistContext, probe: list, slowdown: float) -> Stream:
    """The stream's first shares (equal, or by free memory or measured speed on `probe`, the SAEs
    this rank trains on its share of the rows)."""
    plan, why = first_plan(cfg, ctx, probe, slowdown)
    return Stream(plan, BalanceState.fresh(ctx.world_size), why)


def resume(cfg: TrainConfig, ctx: D.DistContext, members: list, source: ActivationSource, latest: Path,
           run_dir: Path, probe: list, slowdown: float) -> tuple[int, Stream]:
    """Everything back as the checkpoint `latest` left it: every SAE's weights, optimizer and
    counters, the stream's position, the CPU RNG and the shares; returns its step and the stream.
    On another number of ranks the global batch is kept (sae_dist.train.shares.resumed_plan)."""
    weights, saved, meta = on_main(ctx, load_checkpoint, latest)  # read once, broadcast to every rank
    step = int(saved["step"])
    apart = [m for m in members if m.run_dir != run_dir]  # a sweep's SAEs: their weights in their own folders
    missing = sorted({m.name for m in apart} - set(saved.get("saes", {})))
    if missing:
        raise UserError(f"--resume: the checkpoint {latest} has no SAE {', '.join(missing)}; resume with "
                        f"the sweep it was written by")
    saved_world = int(meta.get("world_size") or 0)
    plan, why = resumed_plan(cfg, ctx, saved.get("plan"), saved_world, probe, slowdown)
    # The rebalancer goes on with its streaks, last move and moves so far; on new shares (other
    # ranks, other batch settings) its streaks start again.
    saved_balance = saved.get("balance") or {}
    balance = (BalanceState.from_dict(saved_balance, ctx.world_size) if plan.to_dict() == saved.get("plan")
               else BalanceState.fresh(ctx.world_size, int(saved_balance.get("moves", 0))))
    # One stream shared by every rank (a step's samples never depend on the shares or the number
    # of ranks): one position, whoever wrote it.
    source.use_global_batch(plan.global_batch)
    data = saved["data"]
    source.load_state_dict(data[0] if isinstance(data, list) else data)
    torch.set_rng_state(saved["rng_cpu"])
    for m in members:
        counters = saved if m.run_dir == run_dir else saved["saes"][m.name]
        m.failed = counters.get("failed")
        m.state.step, m.state.samples_total = step, int(counters["samples_total"])
        m.state.since_fired.copy_(counters["since_fired"])
        m.state.fire_total.copy_(counters["fire_total"])
        m.state.parked_fired = _parked(counters.get("parked_fired"), m.state.fire_total)
        # Absent before 2026-11-29: the bias starts afresh; a run resumed with the bias off keeps it off.
        if m.state.rare is not None and "selection_bias" in counters:
            m.state.selection_bias, m.state.fire_rate = (
                None if t is None else t.to(m.state.fire_total.device)
                for t in (counters["selection_bias"], counters["fire_rate"]))
        m.state.refresh_dead(m.cfg.dead_after_samples)
        _match_inner_weight(m, counters, ctx.is_main)
        if m.here and m.live:
            own = (weights, saved) if m.run_dir == run_dir else _sae_checkpoint(m, ctx, step)
            _match_inner_offset(m, own[0], latest, ctx.is_main)
            m.sae.load_state_dict(own[0])
            load_optimizer(m.opt, m.sae, own[1]["optimizer"])
            refit.from_checkpoint(m, own[1], ctx.rank, step, cfg.steps)
    if ctx.is_main:
        log.info("resumed from %s at step %d%s", latest, step,
                 f" ({saved_world} ranks then, {ctx.world_size} now: {why})" if saved_world != ctx.world_size else "")
    return step, Stream(plan, balance, why)


def _match_inner_offset(m, weights: dict[str, Tensor], latest: Path, log_it: bool) -> None:
    """Matryoshka's inner offset as the checkpoint has it: a checkpoint written before the offset
    existed (2026-11-30) goes on without it, as its run began; one trained with it cannot go on
    without it."""
    saved = "W_inner_offset" in weights
    if saved == (m.sae.inner_offset is not None):
        return
    if saved:
        raise UserError(f"--resume: the checkpoint {latest} was trained with Matryoshka's inner offset; "
                        f"resume with --matryoshka-inner-offset (or without --no-matryoshka-inner-offset)")
    m.sae.drop_inner_offset()
    m.opt = optimizer_for(m.sae, m.cfg)
    if log_it:
        log.info("%s: the checkpoint was written without the inner offset; the run goes on without it", m.name)


def _match_inner_weight(m, counters: dict, log_it: bool) -> None:
    """Matryoshka's inner weight as the run began: a checkpoint of a run at a constant weight (every
    one written before the schedule existed, 2026-12-01) goes on at that weight."""
    if m.inner_weight is None or "inner_weight_start" in counters:
        return
    weight, start, until = m.inner_weight
    m.inner_weight = (weight, weight, until)
    if log_it and start != weight:
        log.info("%s: the checkpoint was trained at a constant inner weight; the run goes on at %g",
                 m.name, weight)


def _parked(parked: Tensor | None, like: Tensor) -> Tensor | None:
    """The firings parked since the last check, then the chosen activations' sum and count (absent
    before 2026-11-29: 0, 0), on the counters' device; absent before 2026-11-28, when each report
    moved the dead set: None."""
    if parked is None:
        return None
    parked = parked.to(like.device)
    return torch.cat([parked, parked.new_zeros(2)]) if parked.numel() == like.numel() else parked


def _sae_checkpoint(m, ctx: D.DistContext, step: int):
    """A sweep's SAE's checkpoint of `step`, read by its leader and sent to the rest of its group."""
    box: list[Any] = [None]
    if ctx.rank == m.leader:
        path = checkpoint_dir(m.run_dir) / f"step_{step:08d}"
        try:
            weights, state, _ = load_checkpoint(path)
            box = [("ok", (weights, state))]
        except UserError as e:
            box = [("error", f"{m.name}: {e}")]
    if len(m.ranks) > 1:
        dist.broadcast_object_list(box, src=m.leader, group=m.group)
    if box[0][0] == "error":
        raise UserError(box[0][1])
    return box[0][1]


def write_checkpoint(cfg: TrainConfig, ctx: D.DistContext, members: list, source: ActivationSource,
                     stream: Stream, step: int, run_dir: Path) -> None:
    """What `resume` reads back. A sweep's SAEs each in their own folder (written by the group's
    first rank); then the run's checkpoint (rank 0): every rank's stream position, the CPU RNG,
    the shares and the rebalancer, every SAE's counters, and the weights and optimizer of the SAE
    whose folder is the run's (a single run: one file, as it always was)."""
    data_states = D.gather_objects(source.state_dict())
    refits = {m.name: refit.to_checkpoint(m, ctx.rank) for m in members}  # each group's sums onto its leader
    apart = [m for m in members if m.run_dir != run_dir]
    for m in apart:
        if m.live and ctx.rank == m.leader:
            save_checkpoint(m.run_dir, step=step, weights=dict(m.sae.state_dict()),
                            state={"optimizer": m.opt.state_dict(), "step": step, **refits[m.name]},
                            meta={"sweep_point": m.name, "config": m.cfg.to_dict()}, keep=cfg.keep_checkpoints)
    if apart:
        D.barrier()  # the run's checkpoint exists only once every SAE's of its step is written
    if ctx.is_main:
        saved: dict[str, Any] = {"step": step, "data": data_states, "rng_cpu": torch.get_rng_state(),
                                 "plan": stream.plan.to_dict(), "balance": stream.balance.to_dict()}
        weights: dict[str, Any] = {}
        for m in members:
            counters = {"samples_total": m.state.samples_total, "since_fired": m.state.since_fired.cpu(),
                        "fire_total": m.state.fire_total.cpu(), "failed": m.failed}
            if m.state.parked_fired is not None:
                counters["parked_fired"] = m.state.parked_fired.cpu()
            if m.inner_weight is not None and m.inner_weight[1] != m.inner_weight[0]:
                counters["inner_weight_start"] = m.inner_weight[1]  # absent: a run at a constant weight
            if m.state.rare is not None:  # None once the bias is gone
                counters["selection_bias"], counters["fire_rate"] = (
                    None if t is None else t.cpu() for t in (m.state.selection_bias, m.state.fire_rate))
            if m.run_dir == run_dir:
                weights = dict(m.sae.state_dict())
                saved.update(counters, optimizer=m.opt.state_dict(), **refits[m.name])
            else:
                saved.setdefault("saes", {})[m.name] = counters
        meta = {"world_size": ctx.world_size, "config": cfg.to_dict(),
                "saved_at": datetime.now(timezone.utc).isoformat(),
                **({"sweep": [m.name for m in apart]} if apart else {})}
        path = save_checkpoint(run_dir, step=step, weights=weights, state=saved, meta=meta, keep=cfg.keep_checkpoints)
        log.info("checkpoint: %s%s", path, " (and each SAE's under saes/)" if apart else "")
    D.barrier()

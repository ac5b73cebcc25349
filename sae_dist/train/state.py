"""Where a run is, how it starts, and what its checkpoints hold.

A fresh run initialises b_dec at the mean of its first batch; a resumed one reads its latest
checkpoint once on rank 0 and broadcasts it: weights, optimizer, the data stream's position, the
dead-latent counters, the CPU RNG and the shares of a step. `write_checkpoint` saves exactly what
`start_or_resume` reads back, so a resumed run continues with the batches the uninterrupted run
would have had.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.data.sources.base import ActivationSource
from sae_dist.errors import UserError
from sae_dist.train.balance import BalanceState, BatchPlan
from sae_dist.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from sae_dist.train.run_record import RunRecord
from sae_dist.train.shares import first_plan, resumed_plan

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The run's position besides the weights and the optimizer; the same on every rank (the
    counters are updated from all-reduced sums)."""

    step: int
    samples_total: int
    since_fired: Tensor  # samples since each latent last fired
    fire_total: Tensor  # times each latent fired: the export's feature density
    plan: BatchPlan  # how a step's samples are shared among the ranks
    balance: BalanceState  # the rebalancer's streaks and moves so far
    dead: Tensor | None = None  # latents dead long enough for AuxK; None when none are

    def refresh_dead(self, dead_after_samples: int) -> Tensor:
        """The dead mask; kept as None when no latent is dead (read at reports only: no device sync
        per step)."""
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


def start_or_resume(cfg: TrainConfig, ctx: D.DistContext, sae, opt, source: ActivationSource, run_dir: Path,
                    record: RunRecord, device_ids: list[str],
                    slowdown: float) -> tuple[TrainState, str, list[Tensor] | None]:
    """(state, why the shares are what they are, the first step's batches on a fresh start)."""
    zeros = torch.zeros(cfg.resolved_d_sae, dtype=torch.float64, device=ctx.device)
    latest = latest_checkpoint(run_dir) if cfg.resume else None
    if latest is not None:
        state, why = _resume(cfg, ctx, sae, opt, source, latest, zeros, slowdown)
        record.resumed_at(state.step, ctx.world_size, device_ids)
        if ctx.is_main:
            record.restart_event(state.step, state.plan)
        return state, why, None
    plan, why = first_plan(cfg, ctx, sae, slowdown)
    state = TrainState(0, 0, zeros, zeros.clone(), plan, BalanceState.fresh(ctx.world_size))
    state.refresh_dead(cfg.dead_after_samples)
    # b_dec starts at the data mean (all-reduced), so the first latents explain variation,
    # not the offset. The batch is then trained on like any other.
    first_batches = source.next_batches(plan, ctx.rank, ctx.device)
    with torch.no_grad():
        local = torch.cat(first_batches)
        total = D.all_reduce_sum(torch.cat([local.sum(0), local.new_tensor([len(local)])]))
        sae.b_dec.copy_(total[:-1] / total[-1])
    return state, why, first_batches


def _resume(cfg, ctx, sae, opt, source: ActivationSource, latest: Path, zeros: Tensor,
            slowdown: float) -> tuple[TrainState, str]:
    weights, saved, meta = on_main(ctx, load_checkpoint, latest)  # read once, broadcast to every rank
    saved_world = int(meta.get("world_size") or 0)
    sae.load_state_dict(weights)
    opt.load_state_dict(saved["optimizer"])
    plan, why = resumed_plan(cfg, ctx, saved.get("plan"), saved_world, sae, slowdown)
    # The rebalancer goes on with its streaks, last move and moves so far; on new shares (other
    # ranks, other batch settings) its streaks start again.
    saved_balance = saved.get("balance") or {}
    balance = (BalanceState.from_dict(saved_balance, ctx.world_size) if plan.to_dict() == saved.get("plan")
               else BalanceState.fresh(ctx.world_size, int(saved_balance.get("moves", 0))))
    # One stream shared by every rank (a step's samples never depend on the shares or the number
    # of ranks): one position, whoever wrote it.
    source.use_global_batch(plan.global_batch)
    source.load_state_dict(saved["data"][0])
    state = TrainState(int(saved["step"]), int(saved["samples_total"]), zeros.copy_(saved["since_fired"]),
                       zeros.clone().copy_(saved["fire_total"]), plan, balance)
    state.refresh_dead(cfg.dead_after_samples)
    torch.set_rng_state(saved["rng_cpu"])
    if ctx.is_main:
        log.info("resumed from %s at step %d%s", latest, state.step,
                 f" ({saved_world} ranks then, {ctx.world_size} now: {why})" if saved_world != ctx.world_size else "")
    return state, why


def write_checkpoint(cfg: TrainConfig, ctx: D.DistContext, sae, opt, source: ActivationSource, state: TrainState,
                     run_dir: Path) -> None:
    """Every rank's data position gathered, rank 0 writes; the others wait at the barrier."""
    data_states = D.gather_objects(source.state_dict())
    if ctx.is_main:
        weights = {k: v for k, v in sae.state_dict().items()}
        saved = {
            "optimizer": opt.state_dict(), "step": state.step, "samples_total": state.samples_total,
            "data": data_states, "since_fired": state.since_fired.cpu(), "fire_total": state.fire_total.cpu(),
            "rng_cpu": torch.get_rng_state(), "plan": state.plan.to_dict(), "balance": state.balance.to_dict(),
        }
        meta = {"world_size": ctx.world_size, "config": cfg.to_dict(),
                "saved_at": datetime.now(timezone.utc).isoformat()}
        path = save_checkpoint(run_dir, step=state.step, weights=weights, state=saved, meta=meta,
                               keep=cfg.keep_checkpoints)
        log.info("checkpoint: %s", path)
    D.barrier()

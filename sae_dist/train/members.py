"""The SAEs one job trains, as one rank sees them: a single run is one SAE on every rank, a sweep
many, each on the ranks its placement gave it (sae_dist.sweeps.placement).

Every rank reads its share of each step's global batch from the one stream (the stream's
BatchPlan, which the rebalancer moves). An SAE whose group is every rank trains on each rank's
share as it was read. An SAE on fewer ranks trains on the global batch all-gathered (each sample
was read once, by one rank), split among its group by the stream's shares of those ranks (a
group of one: all of it). So every SAE sees the same rows in the same order, whatever the shares
and the number of ranks, which is why a sweep's SAE equals the same SAE trained alone.

Every rank keeps every SAE's counters (TrainState) and metrics window, updated from sums
all-reduced over the whole world, to which the ranks outside an SAE's group add zeros: every
rank takes the same decisions (report, NaN, dead latents) and rank 0 writes every SAE's rows.
Only the ranks of an SAE's group hold its weights and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.balance import BatchPlan, bounded_split
from sae_dist.train.rare_bias import rule_for
from sae_dist.train.run_record import RunRecord
from sae_dist.train.state import TrainState
from sae_dist.train.step import optimizer_for, wrap_ddp
from sae_dist.train.window import MetricsWindow


@dataclass
class Member:
    """One SAE of the job on this rank."""

    name: str
    cfg: TrainConfig
    ranks: tuple[int, ...]  # its DDP group, in rank order (one rank: no DDP)
    state: TrainState  # its counters; state.plan: how its group shares each global micro-batch
    window: MetricsWindow
    run_dir: Path
    record: RunRecord | None = None  # rank 0's rows (None elsewhere, and for an SAE that had failed)
    sae: SparseAutoencoder | None = None  # None where this rank is not in its group
    opt: torch.optim.Optimizer | None = None
    model: Any = None  # the SAE, or DDP around it over its group
    group: Any = None  # its torch.distributed group (None: one rank, or the whole world)
    failed: str | None = None  # why it stopped (NaN / inf), the same on every rank
    site: int | None = None  # its slice of rows of several model sites (None: rows are its own)
    last_metrics: dict = field(default_factory=dict)
    refit: Any = None  # its decoder refit's sums inside the refit window (sae_dist.train.refit), on its group's ranks
    # Matryoshka's inner weight over the run as (weight, start, until) (sae_dist.train.inner_weight); None for
    # the other architectures
    inner_weight: tuple[float, float, float] | None = None

    @property
    def here(self) -> bool:
        return self.sae is not None

    @property
    def live(self) -> bool:
        return self.failed is None

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def plan(self) -> BatchPlan:
        return self.state.plan

    def group_rank(self, rank: int) -> int:
        return self.ranks.index(rank)

    def rows(self, local: list[torch.Tensor], gathered: list[torch.Tensor] | None, rank: int) -> list[torch.Tensor]:
        """This rank's rows of the step for this SAE: its own share where the group is every rank,
        else its part of the all-gathered global batch."""
        if gathered is None:
            return local
        gi = self.group_rank(rank)
        start = self.plan.offset(gi)
        return [x[start:start + self.plan.shares[gi]] for x in gathered]


def build_member(name: str, cfg: TrainConfig, ranks: tuple[int, ...], run_dir: Path, stream: BatchPlan,
                 ctx: D.DistContext, site: int | None = None) -> Member:
    """An SAE's group, plan, counters and window; its model where this rank is in its group. Every
    rank calls this for every SAE in the same order (new_group requires it)."""
    group = dist.new_group(list(ranks)) if 1 < len(ranks) < ctx.world_size else None
    zeros = torch.zeros(cfg.resolved_d_sae, dtype=torch.float64, device=ctx.device)
    state = TrainState(0, 0, zeros, zeros.clone(), group_plan(stream, ranks))
    state.refresh_dead(cfg.dead_after_samples)
    state.start_rare_bias(rule_for(cfg), cfg.k)
    window = MetricsWindow(cfg.d_in, cfg.resolved_d_sae, ctx.device, chosen=state.rare is not None)
    m = Member(name, cfg, ranks, state, window, run_dir, group=group, site=site,
               inner_weight=cfg.resolved_matryoshka_inner_weight if cfg.architecture == "matryoshka" else None)
    if ctx.rank in ranks:
        m.sae = build_sae(cfg, ctx.device)
        m.opt = optimizer_for(m.sae, cfg)
        m.model = wrap_ddp(m.sae, ctx, cfg, ranks=len(ranks), group=group)
    return m


def build_sae(cfg: TrainConfig, device) -> SparseAutoencoder:
    """The SAE a config describes (d_in already resolved from the source)."""
    return SparseAutoencoder(
        cfg.d_in, cfg.resolved_d_sae, cfg.architecture, cfg.k, l1_coefficient=cfg.l1_coefficient,
        l0_coefficient=cfg.l0_coefficient, auxk_coefficient=cfg.auxk_coefficient,
        auxk_k=cfg.resolved_auxk_k, jumprelu_init_threshold=cfg.jumprelu_init_threshold,
        jumprelu_bandwidth=cfg.jumprelu_bandwidth, seed=cfg.seed, device=device,
        matryoshka_widths=cfg.resolved_matryoshka_widths if cfg.architecture == "matryoshka" else None,
        matryoshka_selection=cfg.matryoshka_selection or "sample",
        matryoshka_inner_weight=1.0 if cfg.matryoshka_inner_weight is None else cfg.matryoshka_inner_weight,
        matryoshka_inner_offset=bool(cfg.resolved_matryoshka_inner_offset),
        transcoder=cfg.transcode is not None,
        skip=cfg.skip)


def group_plan(stream: BatchPlan, ranks: tuple[int, ...]) -> BatchPlan:
    """How an SAE's group shares each global micro-batch: the stream's own plan where the group is
    every rank; else the stream's shares of the group's ranks, scaled to the whole micro-batch."""
    if len(ranks) == stream.world_size:
        return stream
    weights = [float(stream.shares[r]) for r in ranks]
    return BatchPlan(stream.global_batch, stream.micro_steps, bounded_split(stream.micro_batch, weights))


def follow_stream(members: list[Member], stream: BatchPlan) -> None:
    """The stream's shares moved (or were set at a resume): every SAE's group follows them."""
    for m in members:
        m.state.plan = group_plan(stream, m.ranks)


def all_gathered(local: list[torch.Tensor], stream: BatchPlan) -> list[torch.Tensor]:
    """Every rank's share of each micro-batch, in rank order: the step's global batch on every
    rank. Shares may differ (rebalanced), so each is padded to the largest for the collective."""
    width = max(stream.shares)
    out = []
    for x in local:
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[:len(x)] = x
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, padded)
        out.append(torch.cat([p[:s] for p, s in zip(parts, stream.shares)]))
    return out


def split_sites(batches: list[torch.Tensor], n_sites: int) -> dict[int | None, list[torch.Tensor]]:
    """A step's batches by site: {None: them} for rows of one site; else {i: site i's rows}, each
    made contiguous once per step (an SAE reads them as a run from that site alone would)."""
    if n_sites <= 1:
        return {None: batches}
    return {i: [x[:, i].contiguous() for x in batches] for i in range(n_sites)}


def init_b_dec(members: list[Member], first: dict[int | None, list[torch.Tensor]]) -> None:
    """b_dec at the mean of the first global batch of its site (all-reduced), so that the first
    latents explain variation, not the offset (a transcoder's b_in too, at its input's mean); the
    batch is then trained on like any other."""
    with torch.no_grad():
        for site, batches in first.items():
            local = torch.cat(batches)
            total = D.all_reduce_sum(torch.cat([local.sum(0), local.new_tensor([len(local)])]))
            for m in members:
                if m.here and m.site == site:
                    m.sae.set_offsets(total[:-1] / total[-1])


def open_sweep_records(members: list[Member], ctx: D.DistContext, sweep_name: str, sweep_id: int | None,
                     device_ids: list[str]) -> None:
    """Rank 0's run row for each SAE of a sweep still training, naming its sweep (a resumed sweep
    finds its rows by directory)."""
    if not ctx.is_main:
        return
    for m in members:
        if not m.live:
            continue
        m.run_dir.mkdir(parents=True, exist_ok=True)
        ids = [device_ids[r] for r in m.ranks]
        m.record = RunRecord(m.cfg, ctx, f"{sweep_name}/{m.name}", str(m.run_dir.resolve()), ids)
        if m.record.writer is not None:
            m.record.writer.update_run(sweep_id=sweep_id, sweep_point=m.name, world_size=len(m.ranks),
                                       backend=ctx.backend if len(m.ranks) > 1 else "none")

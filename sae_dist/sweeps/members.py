"""The SAEs of a sweep as one rank sees them: their DDP groups, models, counters, rows and
checkpoints (the loop is sae_dist/sweeps/train.py).

Every rank keeps every SAE's counters (TrainState) and metrics window, updated from sums
all-reduced over the whole world to which the ranks outside an SAE's group add zeros: so every
rank takes the same decisions (report, NaN, dead latents) and rank 0 writes every SAE's rows.
Only the ranks of an SAE's group hold its weights and optimizer.

Checkpoints: each SAE's weights and optimizer under RUN_DIR/saes/<name>/checkpoints (written by
its group's first rank), then the sweep's own under RUN_DIR/checkpoints (rank 0): the stream's
position once, the CPU RNG and every SAE's counters and end. A sweep checkpoint exists only once
every SAE's of its step is written, so a resume from it finds them all.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract.sweep import Sweep
from sae_dist.data.harvest.sites import model_sites
from sae_dist.data.sources.make import make_source
from sae_dist.errors import UserError
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.sweeps.placement import Device, Placement
from sae_dist.train.balance import BalanceState, BatchPlan, split
from sae_dist.train.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from sae_dist.train.run_record import RunRecord
from sae_dist.train.state import TrainState, on_main
from sae_dist.train.step import compress_hook, ddp_bucket_mb, make_optimizer
from sae_dist.train.window import MetricsWindow

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One SAE of the sweep on this rank."""

    name: str
    cfg: TrainConfig
    ranks: tuple[int, ...]  # its DDP group, in rank order (one rank: no DDP)
    plan: BatchPlan  # how its group shares each global micro-batch (equal shares)
    state: TrainState
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

    @property
    def here(self) -> bool:
        return self.sae is not None

    @property
    def live(self) -> bool:
        return self.failed is None

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def group_rank(self, rank: int) -> int:
        return self.ranks.index(rank)

    def slices(self, global_batches: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """This rank's part of each global micro-batch (a group of one: all of it)."""
        gi = self.group_rank(rank)
        start = self.plan.offset(gi)
        return [x[start:start + self.plan.shares[gi]] for x in global_batches]


def sweep_source(cfg: TrainConfig, sweep: Sweep, ctx: D.DistContext):
    """The one stream of the sweep. From the model: one forward pass hooks every (layer, site)
    its SAEs read (rows [rows, n_sites, d_in]); one site only is exactly a plain run's source."""
    sites = model_sites(sweep)
    if not sites:
        return make_source(cfg, ctx)
    (layer, site), *more = sites
    if not more:
        return make_source(dataclasses.replace(cfg, model_layer=layer, model_site=site), ctx)
    from sae_dist.data.sources.model import ModelSource

    if ctx.is_main:
        log.info("the model source hooks %d sites in one forward pass (%s); its fill holds %dx a site's rows",
                 len(sites), ", ".join(f"L{layer} {site}" for layer, site in sites), len(sites))
    return ModelSource(cfg.model_path, layer, site, cfg.text_path, cfg.context_length, cfg.batch_size, cfg.seed,
                       ctx.rank, ctx.world_size, ctx.device,
                       global_batch=cfg.batch_size * ctx.world_size * cfg.grad_accum, sites=sites)


def split_sites(batches: list[torch.Tensor], n_sites: int) -> dict[int | None, list[torch.Tensor]]:
    """A step's batches by site: {None: them} for rows of one site; else {i: site i's rows}, each
    made contiguous once per step (an SAE reads them as a run from that site alone would)."""
    if n_sites <= 1:
        return {None: batches}
    return {i: [x[:, i].contiguous() for x in batches] for i in range(n_sites)}


def rank_devices(ctx: D.DistContext) -> list[Device]:
    """The job's devices as the planner sees them: one per rank, named by rank, with its memory."""
    capacity = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else None
    return [Device(f"{ctx.device.type}:{r}", c) for r, c in enumerate(D.gather_objects(capacity))]


def job_devices(kind: str, count: int) -> list[Device]:
    """The same from the launcher, before any rank starts (CPU memory is not a limit we know)."""
    if kind != "cuda":
        return [Device(f"cpu:{r}", None) for r in range(count)]
    return [Device(f"cuda:{r}", torch.cuda.get_device_properties(r).total_memory) for r in range(count)]


def build_members(sweep: Sweep, placement: Placement, ctx: D.DistContext, run_dir: Path,
                  global_plan: BatchPlan, source=None) -> list[Member]:
    """Every SAE's group, plan, counters and window; its model where this rank is in its group.
    new_group is called by every rank for every group, in the sweep's order (torch requires it).
    A source with rows of several sites gives each SAE its site."""
    names = [d.device for d in placement.devices]
    site_of = getattr(source, "site_of", None)
    members = []
    for point in sweep.points:
        cfg = point.config
        ranks = tuple(sorted(names.index(d) for d in placement.group_of(point.name)))
        group = dist.new_group(list(ranks)) if 1 < len(ranks) < ctx.world_size else None
        plan = BatchPlan(global_plan.global_batch, global_plan.micro_steps,
                         split(global_plan.micro_batch, [1.0] * len(ranks)))
        zeros = torch.zeros(cfg.resolved_d_sae, dtype=torch.float64, device=ctx.device)
        state = TrainState(0, 0, zeros, zeros.clone(), plan, BalanceState.fresh(len(ranks)))
        state.refresh_dead(cfg.dead_after_samples)
        m = Member(point.name, cfg, ranks, plan, state, MetricsWindow(cfg.d_in, cfg.resolved_d_sae, ctx.device),
                   run_dir / "saes" / point.name, group=group,
                   site=site_of(cfg.model_layer, cfg.model_site) if site_of else None)
        if ctx.rank in ranks:
            from sae_dist.train.loop import build_sae

            m.sae = build_sae(cfg, ctx.device)
            m.opt = make_optimizer(m.sae, cfg.resolved_lr)
            m.model = _wrap(m, ctx)
        members.append(m)
    return members


def _wrap(m: Member, ctx: D.DistContext):
    if len(m.ranks) == 1:
        return m.sae
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(m.sae, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                process_group=m.group, gradient_as_bucket_view=True, bucket_cap_mb=ddp_bucket_mb(m.sae, m.cfg))
    if m.cfg.ddp_compress != "none" and m.group is None:  # its hook averages over the whole world
        model.register_comm_hook(
            None, compress_hook(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[m.cfg.ddp_compress])))
    return model


def open_records(members: list[Member], ctx: D.DistContext, sweep_name: str, sweep_id: int | None,
                 device_ids: list[str]) -> None:
    """Rank 0's run row for each SAE still training (a resumed sweep finds its rows by directory)."""
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


# ---- checkpoints ----


def write_sweep_checkpoint(cfg: TrainConfig, ctx: D.DistContext, members: list[Member], source, step: int,
                           run_dir: Path) -> None:
    """Each live SAE's weights and optimizer (its leader), then the sweep's state (rank 0)."""
    for m in members:
        if m.live and ctx.rank == m.leader:
            save_checkpoint(m.run_dir, step=step, weights=dict(m.sae.state_dict()),
                            state={"optimizer": m.opt.state_dict(), "step": step},
                            meta={"sweep_point": m.name, "config": m.cfg.to_dict()}, keep=cfg.keep_checkpoints)
    D.barrier()
    if ctx.is_main:
        saved = {"step": step, "data": source.state_dict(), "rng_cpu": torch.get_rng_state(),
                 "saes": {m.name: {"samples_total": m.state.samples_total, "since_fired": m.state.since_fired.cpu(),
                                   "fire_total": m.state.fire_total.cpu(), "failed": m.failed} for m in members}}
        meta = {"world_size": ctx.world_size, "config": cfg.to_dict(), "sweep": [m.name for m in members],
                "saved_at": datetime.now(timezone.utc).isoformat()}
        path = save_checkpoint(run_dir, step=step, weights={}, state=saved, meta=meta, keep=cfg.keep_checkpoints)
        log.info("checkpoint: %s (and each SAE's under saes/)", path)
    D.barrier()


def resume_members(members: list[Member], ctx: D.DistContext, source, latest: Path) -> int:
    """Everything back as the sweep's checkpoint `latest` left it; returns its step."""
    _, saved, _ = on_main(ctx, load_checkpoint, latest)  # read once, broadcast to every rank
    step = int(saved["step"])
    missing = sorted(set(m.name for m in members) - set(saved["saes"]))
    if missing:
        raise UserError(f"--resume: the checkpoint {latest} has no SAE {', '.join(missing)}; resume with "
                        f"the sweep it was written by")
    source.load_state_dict(saved["data"])
    torch.set_rng_state(saved["rng_cpu"])
    for m in members:
        s = saved["saes"][m.name]
        m.failed = s["failed"]
        m.state.step, m.state.samples_total = step, int(s["samples_total"])
        m.state.since_fired.copy_(s["since_fired"])
        m.state.fire_total.copy_(s["fire_total"])
        m.state.refresh_dead(m.cfg.dead_after_samples)
        if m.here and m.live:
            weights, state = _sae_checkpoint(m, ctx, step)
            m.sae.load_state_dict(weights)
            m.opt.load_state_dict(state["optimizer"])
    return step


def _sae_checkpoint(m: Member, ctx: D.DistContext, step: int):
    """The SAE's checkpoint of `step`, read by its leader and sent to the rest of its group."""
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

"""What a sweep adds to a training job before its SAEs are built: the one stream its SAEs read
(every layer and site of a model in one forward pass) and the job's devices as the placement sees
them, from a rank or from the launcher."""

from __future__ import annotations

import dataclasses
import logging

import torch

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract.sweep import Sweep
from sae_dist.data.harvest.sites import model_sites
from sae_dist.data.sources.make import make_source
from sae_dist.sweeps.placement import Device

log = logging.getLogger(__name__)


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


def resolved(sweep: Sweep, world_size: int) -> Sweep:
    """Every point's rule-based defaults as numbers, for this many ranks."""
    points = tuple(dataclasses.replace(p, config=p.config.resolved(world_size)) for p in sweep.points)
    return Sweep(sweep.keys, points)


def rank_devices(ctx: D.DistContext) -> list[Device]:
    """The job's devices as the planner sees them: one per rank, named by rank, with its memory."""
    capacity = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.device.type == "cuda" else None
    return [Device(f"{ctx.device.type}:{r}", c) for r, c in enumerate(D.gather_objects(capacity))]


def job_devices(kind: str, count: int) -> list[Device]:
    """The same from the launcher, before any rank starts (CPU memory is not a limit we know)."""
    if kind != "cuda":
        return [Device(f"cpu:{r}", None) for r in range(count)]
    return [Device(f"cuda:{r}", torch.cuda.get_device_properties(r).total_memory) for r in range(count)]

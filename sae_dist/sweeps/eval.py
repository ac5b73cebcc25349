"""A sweep's end-of-run evaluation: the unseen rows drawn once, every finished SAE evaluated on them.

As a single run (sae_dist/evaluate/end_of_run.py), on rows the sweep never trained on
(ActivationSource.unseen_rows): the stream gives them once, every rank taking part (the model
source draws them collectively); rank 0 holds them, and sends them on to the other ranks only
when some of them lead an SAE (an SAE's weights stay where they trained). Each SAE's leader
evaluates it in the batches a run of that SAE alone would use (so the figures are that run's);
rank 0 records each in the SAE's own run, where a single run records its own: evaluation.json in
its directory and a row in `evaluations`. A failed (diverged) SAE is not evaluated. From shards
harvested from a model, the model check loads the model once per rank for all its SAEs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sae_dist import distributed as D
from sae_dist.evaluate.data import batch_rows_for
from sae_dist.evaluate.end_of_run import evaluate_trained, planted_for, shared_model_check

log = logging.getLogger(__name__)


def evaluate_members(cfg, ctx: D.DistContext, source, members: list, plan) -> dict[str, tuple[Any, str]]:
    """Every rank calls this after the last step; rank 0 gets {SAE name: (Evaluation, which rows)}
    for each live SAE, the others {}. {} everywhere with eval_rows 0 or a source without rows."""
    live = [m for m in members if m.live]
    if cfg.eval_rows == 0 or not live:
        return {}
    shared = any(m.leader != 0 for m in live)  # the same on every rank: all ranks take part, or rank 0 alone
    rows, where = _draw_once(cfg, ctx, source, live, plan, shared)
    if rows is None:
        return {}
    leading = any(ctx.rank == m.leader for m in live)
    planted = planted_for(cfg) if leading else None
    check = shared_model_check(cfg) if leading else None  # harvested shards: the model loaded once, not per SAE
    mine = {m.name: evaluate_trained(m.cfg, m.sae, _site(rows, m.site).split(batch_rows_for(m.sae.d_sae)), planted,
                                     check)
            for m in live if ctx.rank == m.leader}
    parts = D.gather_objects(mine) if shared else [mine]
    if not ctx.is_main:
        return {}
    return {name: (ev, where) for part in parts for name, ev in part.items()}


def _draw_once(cfg, ctx: D.DistContext, source, live: list, plan,
               shared: bool) -> tuple[torch.Tensor | None, str]:
    """The unseen rows as one CPU tensor on rank 0, and with `shared` on every rank (None on the
    others, and everywhere when the source has none)."""
    batch_rows = min(batch_rows_for(m.cfg.resolved_d_sae) for m in live)
    unseen = source.unseen_rows(cfg.eval_rows, batch_rows, ctx, plan)  # every rank: the model source draws collectively
    rows = torch.cat(list(unseen.batches)) if unseen is not None else None
    if rows is not None and len(rows) == 0:
        rows = None
    where = unseen.where if unseen is not None else ""
    if shared:
        rows, where = D.broadcast_object((rows, where) if ctx.is_main else None)
    return rows, where


def _site(rows: torch.Tensor, site: int | None) -> torch.Tensor:
    """An SAE's rows of a model source hooking several sites ([rows, n_sites, d_in]): its slice."""
    return rows if site is None else rows[:, site].contiguous()

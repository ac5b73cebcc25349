"""The evaluation every run ends with: its SAE on rows it never trained on.

Which rows: shards hold out their tail (the stream never draws it); the synthetic stream's rows
after the run's last sample; the model source's next rows (the text after what it trained on).
Planted data (synthetic, or shards written by make-planted) also gets feature recovery, and
shards harvested from a model get the model's own check (the SAE spliced in).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from sae_dist import distributed as D
from sae_dist.format import fmt_percent
from sae_dist.evaluate.data import batch_rows_for, heldout_batches
from sae_dist.evaluate.metrics import Evaluation, Planted, evaluate_sae
from sae_dist.evaluate.planted import load_planted, planted_from_settings

log = logging.getLogger(__name__)


def end_of_run_evaluation(cfg, sae, source, ctx: D.DistContext, plan) -> tuple[Evaluation, str] | None:
    """Every rank calls this (the model source draws its rows collectively); rank 0 gets the
    evaluation and a few words saying which rows, the others None. None too when eval_rows is 0."""
    if cfg.eval_rows == 0:
        return None
    model_rows = _model_rows(source, ctx, plan, cfg.eval_rows) if cfg.source == "model" else None
    if not ctx.is_main:
        return None
    planted: Planted | None = None
    batch = batch_rows_for(sae.d_sae)
    if cfg.source == "synthetic":
        n = cfg.eval_rows
        start = source.position  # the stream's rows after the run's last: never trained on
        batches: Iterable[Tensor] = (source.samples(start + i, min(batch, n - i)) for i in range(0, n, batch))
        planted = planted_from_settings(cfg.d_in, cfg.synthetic_features, cfg.synthetic_active,
                                        cfg.synthetic_power_law, cfg.synthetic_noise, cfg.seed)
        where = f"{n:,} synthetic rows after the run's last sample"
    elif cfg.source == "shards":
        n = source.holdout_rows
        if n == 0:
            return None
        batches = heldout_batches(cfg.shards_path, n, batch)
        planted = load_planted(cfg.shards_path)
        where = f"the shards' held-out tail ({n:,} rows no batch drew)"
    else:
        batches = model_rows.split(batch)
        where = f"the model's next {len(model_rows):,} rows (text after the run's)"
    was_training = sae.training
    sae.eval()  # BatchTopK encodes with its learned threshold, as exported
    try:
        evaluation = evaluate_sae(sae, batches, planted)
        if cfg.source == "shards":
            evaluation.model_check = _model_check(sae, cfg.shards_path)
    finally:
        sae.train(was_training)
    return evaluation, where


def _model_rows(source, ctx: D.DistContext, plan, rows: int) -> Tensor | None:
    """The model stream's next `rows` rows (drawn in whole steps by every rank), on rank 0."""
    mine: list[Tensor] = []
    for _ in range(-(-rows // plan.global_batch)):
        mine += [x.detach().float().cpu() for x in source.next_batches(plan, ctx.rank, ctx.device)]
    gathered = D.gather_objects(mine)
    if not ctx.is_main:
        return None
    return torch.cat([x for rank_rows in gathered for x in rank_rows])[:rows]


def _model_check(sae, shards_path: str) -> dict | None:
    """The model splice check for harvested shards; a model that cannot be loaded is a note, not a
    failed run (the SAE and its other metrics are fine)."""
    from sae_dist.evaluate.model_check import model_check

    try:
        return model_check(sae, shards_path)
    except Exception as e:  # noqa: BLE001 - reported, and the run still ends well
        log.warning("model check skipped: %s: %s", type(e).__name__, e)
        return {"kind": "skipped", "reason": f"{type(e).__name__}: {e}"[:500]}


def summary_lines(evaluation: Evaluation, where: str) -> Iterator[str]:
    d = evaluation.to_dict()
    fvu = "unknown" if d["fvu"] is None else f"{d['fvu']:.4f}"
    yield (f"evaluation on {where}: FVU {fvu}, L0 {d['l0']:.1f}, dead {fmt_percent(d['dead_fraction'])}, "
           f"dense {fmt_percent(d['dense_fraction'])}")
    rec = d.get("recovery")
    if rec:
        yield (f"planted features recovered: {fmt_percent(rec['frac_above_0_9'])} at cos > 0.9 "
               f"({fmt_percent(rec['rare_frac_above_0_9'])} of the rarest tenth), mean best cosine "
               f"{rec['mean_best_cos']:.3f}")
    check = d.get("model_check")
    if check and check.get("kind") == "sentence_cosine":
        yield (f"model check: sentence embeddings keep cosine {check['spliced_cosine']:.3f} with the SAE "
               f"spliced in (zero-ablation {check['ablated_cosine']:.3f})")
    elif check and check.get("kind") == "ce_loss_score":
        yield f"model check: CE loss score {check['ce_loss_score']:.3f}"

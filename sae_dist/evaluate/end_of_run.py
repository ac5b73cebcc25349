"""The evaluation every run ends with: its SAE on rows it never trained on.

Which rows is the source's to say (ActivationSource.unseen_rows in sae_dist.data.sources.base): shards
hold out their tail (the stream never draws it); the synthetic stream gives its rows after the
run's last sample; the model source its next rows (the text after what it trained on).
Planted data (synthetic, or shards written by make-planted) also gets feature recovery, and
shards harvested from a model get the model's own check (the SAE spliced in).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from sae_dist import distributed as D
from sae_dist.data.sources.base import ActivationSource
from sae_dist.evaluate.data import batch_rows_for
from sae_dist.evaluate.metrics import Evaluation, Planted, evaluate_sae, matching_text
from sae_dist.evaluate.planted import load_planted, planted_from_settings
from sae_dist.format import fmt_percent

log = logging.getLogger(__name__)


def end_of_run_evaluations(cfg, ctx: D.DistContext, source: ActivationSource, members: list,
                           plan) -> dict[str, tuple[Evaluation, str]]:
    """Every rank calls this after the last step (the model source draws its rows collectively);
    rank 0 gets {SAE name: (Evaluation, which rows)} for each live SAE of the job
    (sae_dist.train.members), the others {}. {} everywhere with eval_rows 0 or a source without rows.

    The unseen rows are drawn once for all the SAEs; rank 0 holds them and sends them on only when
    another rank leads an SAE (an SAE's weights stay where they trained). Each SAE's leader
    evaluates it in the batches a run of that SAE alone would use, so a sweep's figures are those
    of its SAEs trained alone. From harvested shards the model is loaded once per rank for all."""
    live = [m for m in members if m.live]
    if cfg.eval_rows == 0 or not live:
        return {}
    shared = any(m.leader != 0 for m in live)  # the same on every rank: all ranks take part, or rank 0 alone
    rows, where, first_row = _draw_once(cfg, ctx, source, live, plan, shared)
    if rows is None:
        return {}
    leading = any(ctx.rank == m.leader for m in live)
    planted = planted_for(cfg) if leading else None
    if planted is not None:
        planted.first_row = first_row  # the rows' ground truth: latents judged as feature detectors
    check = shared_model_check(cfg) if leading else None
    mine = {m.name: evaluate_trained(m.cfg, m.sae, _site(rows, m.site).split(batch_rows_for(m.sae.d_sae)), planted,
                                     check)
            for m in live if ctx.rank == m.leader}
    parts = D.gather_objects(mine) if shared else [mine]
    if not ctx.is_main:
        return {}
    return {name: (ev, where) for part in parts for name, ev in part.items()}


def _draw_once(cfg, ctx: D.DistContext, source: ActivationSource, live: list, plan,
               shared: bool) -> tuple[torch.Tensor | None, str, int | None]:
    """The unseen rows as one CPU tensor on rank 0, and with `shared` on every rank (None on the
    others, and everywhere when the source has none), which rows, and the synthetic stream's
    position of the first."""
    batch_rows = min(batch_rows_for(m.cfg.resolved_d_sae) for m in live)
    unseen = source.unseen_rows(cfg.eval_rows, batch_rows, ctx, plan)  # every rank: the model source draws collectively
    rows = torch.cat(list(unseen.batches)) if unseen is not None else None
    if rows is not None and len(rows) == 0:
        rows = None
    where = unseen.where if unseen is not None else ""
    first_row = unseen.first_row if unseen is not None else None
    if shared:
        rows, where, first_row = D.broadcast_object((rows, where, first_row) if ctx.is_main else None)
    return rows, where, first_row


def _site(rows: torch.Tensor, site: int | None) -> torch.Tensor:
    """An SAE's rows of a model source hooking several sites ([rows, n_sites, d_in]): its slice."""
    return rows if site is None else rows[:, site].contiguous()


def evaluate_trained(cfg, sae, batches, planted: Planted | None, check=None) -> Evaluation:
    """A trained SAE on unseen rows (`planted`: planted_for(cfg)), with the model check for shards.
    The end of a run calls this for each of its SAEs (`end_of_run_evaluations`), with one `check`
    (shared_model_check) for them all: the model is loaded once per job."""
    was_training = sae.training
    sae.eval()  # BatchTopK encodes with its learned threshold, as exported
    try:
        evaluation = evaluate_sae(sae, batches, planted)
        if cfg.source == "shards":
            evaluation.model_check = _model_check(sae, cfg.shards_path, check)
    finally:
        sae.train(was_training)
    return evaluation


def planted_for(cfg) -> Planted | None:
    """The dictionary the data was made from, when it was: the synthetic stream's settings, or
    planted shards' own file (make-planted)."""
    if cfg.source == "synthetic":
        return planted_from_settings(cfg.d_in, cfg.synthetic_features, cfg.synthetic_active,
                                     cfg.synthetic_power_law, cfg.synthetic_noise, cfg.seed,
                                     children=cfg.synthetic_children, child_prob=cfg.synthetic_child_prob,
                                     magnitude_sigma=cfg.synthetic_magnitude_sigma,
                                     correlation=cfg.synthetic_correlation)
    if cfg.source == "shards":
        return load_planted(cfg.shards_path)
    return None


def shared_model_check(cfg):
    """One model check for every SAE trained on these shards (a sweep's), its model loaded once;
    None for another source. A model that cannot be loaded is each SAE's note (_model_check)."""
    if cfg.source != "shards":
        return None
    from sae_dist.evaluate.model_check import ModelCheck

    try:
        return ModelCheck(cfg.shards_path)
    except Exception as e:  # noqa: BLE001 - reported by each SAE's check, and the runs still end well
        return _skipped(e)


def _model_check(sae, shards_path: str, check=None) -> dict | None:
    """The model splice check for harvested shards (through `check`, one shared_model_check, when
    given); a model that cannot be loaded is a note, not a failed run (the SAE and its other
    metrics are fine)."""
    if isinstance(check, dict):  # the shared check could not load
        log.warning("model check skipped: %s", check["reason"])
        return check
    from sae_dist.evaluate.model_check import ModelCheck

    try:
        return (check or ModelCheck(shards_path))(sae)
    except Exception as e:  # noqa: BLE001 - reported, and the run still ends well
        log.warning("model check skipped: %s: %s", type(e).__name__, e)
        return _skipped(e)


def _skipped(e: Exception) -> dict:
    return {"kind": "skipped", "reason": f"{type(e).__name__}: {e}"[:500]}


def summary_lines(evaluation: Evaluation, where: str) -> Iterator[str]:
    d = evaluation.to_dict()
    fvu = "unknown" if d["fvu"] is None else f"{d['fvu']:.4f}"
    yield (f"evaluation on {where}: FVU {fvu}, L0 {d['l0']:.1f}, dead {fmt_percent(d['dead_fraction'])}, "
           f"dense {fmt_percent(d['dense_fraction'])}")
    rec = d.get("recovery")
    if rec:
        matched = matching_text(rec)
        yield (f"planted features recovered: {fmt_percent(rec['frac_above_0_9'])} at cos > 0.9 "
               f"({fmt_percent(rec['rare_frac_above_0_9'])} of the rarest tenth), mean best cosine "
               f"{rec['mean_best_cos']:.3f}" + (f"; {matched}" if matched else ""))
    check = d.get("model_check")
    if check and check.get("kind") == "sentence_cosine":
        yield (f"model check: sentence embeddings keep cosine {check['spliced_cosine']:.3f} with the SAE "
               f"spliced in (zero-ablation {check['ablated_cosine']:.3f})")
    elif check and check.get("kind") == "ce_loss_score":
        yield f"model check: CE loss score {check['ce_loss_score']:.3f}"

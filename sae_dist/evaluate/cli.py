"""`python -m sae_dist evaluate` and `make-planted`: the commands' work (sae_dist.cli parses)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from sae_dist.errors import DataError
from sae_dist.evaluate.data import DEFAULT_ROWS, evaluate_shards
from sae_dist.evaluate.load import load_sae
from sae_dist.evaluate.metrics import Evaluation, matching_text
from sae_dist.evaluate.planted import write_planted_shards
from sae_dist.format import fmt_percent


def planted_defaults() -> dict[str, float | int]:
    """make-planted's defaults: the trainer's synthetic_* defaults, so both plant the same data."""
    from sae_dist.config import SYNTHETIC_D_IN, config_fields

    defaults = {f.name: f.default for f in config_fields()}
    return {"d_in": SYNTHETIC_D_IN, "features": defaults["synthetic_features"],
            "active": defaults["synthetic_active"], "power_law": defaults["synthetic_power_law"],
            "noise": defaults["synthetic_noise"], "seed": defaults["seed"],
            "children": defaults["synthetic_children"], "child_prob": defaults["synthetic_child_prob"],
            "magnitude_sigma": defaults["synthetic_magnitude_sigma"], "correlation": defaults["synthetic_correlation"]}


def make_planted(ns: argparse.Namespace) -> int:
    defaults = planted_defaults()
    settings = {name: getattr(ns, name) if getattr(ns, name) is not None else default
                for name, default in defaults.items()}
    out = write_planted_shards(ns.out, rows=ns.rows, rows_per_shard=ns.rows_per_shard, **settings)
    print(f"wrote {ns.rows:,} planted rows (d_in {settings['d_in']}, {settings['features']:,} features, "
          f"{settings['active']} active per row on average, power law {settings['power_law']}, noise "
          f"{settings['noise']}, seed {settings['seed']}"
          + (f", {settings['children']} children a parent" if settings['children'] else "")
          + f") to {out}; train on them with "
          f"--source shards --shards-path {out}")
    return 0


def evaluate(ns: argparse.Namespace) -> int:
    if ns.json:  # stdout is the JSON alone: what is logged on the way (the model check's loading) goes to stderr
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    if ns.rows is not None and ns.rows < 1:
        raise DataError(f"--rows {ns.rows}: at least one row is needed to evaluate")
    sae = load_sae(ns.sae_dir)
    rows = ns.rows if ns.rows is not None else _heldout_tail(ns.shards)
    evaluation = evaluate_shards(sae, ns.shards, rows)
    if not getattr(ns, "no_model_check", False):
        from sae_dist.evaluate.model_check import model_check

        evaluation.model_check = model_check(sae, ns.shards)  # None unless harvested from a model
    record = None
    if not ns.no_db:
        from sae_dist.db import get_engine
        from sae_dist.db.evaluations import record_evaluation, run_for_export

        engine = get_engine()
        run_id = run_for_export(engine, ns.sae_dir)
        record = (record_evaluation(engine, evaluation, ns.sae_dir, ns.shards, run_id=run_id, where="cli"), run_id)
    if ns.json:
        print(json.dumps(evaluation.to_dict()))
    else:
        kind = f"{sae.architecture} transcoder" + (" with a skip path" if sae.W_skip is not None else "")
        print(summary(evaluation, kind if sae.transcoder else sae.architecture, sae.d_in, ns.sae_dir, ns.shards))
        if record is not None:
            print(f"recorded as evaluation {record[0]}" + (f" of run {record[1]}" if record[1] is not None else ""))
    return 0


def _heldout_tail(shards: str) -> int:
    """The rows a run on these shards held out (by default), so evaluate reads what it never saw."""
    from sae_dist.data.sources.shards import open_shards
    from sae_dist.defaults import heldout_rows_of

    total = open_shards(shards).total_rows
    return heldout_rows_of(DEFAULT_ROWS, total) or total


def _opt(x: float | None, fmt: str) -> str:
    return "undefined (the rows do not vary)" if x is None else format(x, fmt)


def summary(ev: Evaluation, architecture: str, d_in: int, sae_dir: str | Path, data: str | Path) -> str:
    """The readable report: reconstruction, sparsity, a text density histogram, recovery."""
    dead = round(ev.dead_fraction * ev.d_sae)
    lines = [
        f"SAE {sae_dir} ({architecture}, d_in {d_in}, d_sae {ev.d_sae:,}) on the last {ev.rows:,} rows of {data}",
        f"  FVU                {_opt(ev.fvu, '.4f')}   (explained variance {_opt(ev.explained_variance, '.4f')})",
        f"  MSE                {ev.mse:.6g}   (summed over dims, mean over rows)",
        f"  cosine(x, x_hat)   {ev.cosine:.4f}" + ("   (x: the target a transcoder predicts)"
                                                    if "transcoder" in architecture else ""),
        f"  L0                 {ev.l0:.2f} active latents per row",
        f"  dead latents       {fmt_percent(ev.dead_fraction)}   ({dead:,} of {ev.d_sae:,} never fired on these rows)",
        f"  dense latents      {fmt_percent(ev.dense_fraction)}   (firing on more than 10% of the rows)",
        "  feature density: latents per bin of log10(firing frequency)",
    ]
    counts, edges = ev.density.counts, ev.density.edges
    live = [i for i, c in enumerate(counts) if c]
    biggest = max([ev.density.never, *counts]) or 1
    bar = lambda c: "#" * (round(40 * c / biggest) if c else 0) or ("." if c else "")  # noqa: E731
    if live:
        for i in range(live[0], live[-1] + 1):
            close = "]" if i == len(counts) - 1 else ")"
            lines.append(f"    [{edges[i]:5.1f}, {edges[i + 1]:4.1f}{close} {counts[i]:>8,}  {bar(counts[i])}")
    lines.append(f"    never fired   {ev.density.never:>8,}  {bar(ev.density.never)}")
    r = ev.recovery
    if r is not None:
        lines.append(f"  planted recovery ({r.features:,} features): mean best cosine {r.mean_best_cos:.4f}, "
                     f"{fmt_percent(r.frac_above_0_9)} above 0.9, {fmt_percent(r.frac_above_0_8)} above 0.8")
        lines.append(f"    rarest tenth ({r.rare_features:,}): mean best cosine {r.rare_mean_best_cos:.4f}, "
                     f"{fmt_percent(r.rare_frac_above_0_9)} above 0.9, {fmt_percent(r.rare_frac_above_0_8)} above 0.8")
        matched = matching_text(r.to_dict())
        if matched:
            lines.append(f"    {matched}")
    if ev.model_check:
        lines.append(f"  model check: {json.dumps(ev.model_check)}")
    return "\n".join(lines)


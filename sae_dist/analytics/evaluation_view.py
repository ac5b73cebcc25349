"""A run's SAE evaluation on the Training runs page: the query, its cards and captions, and the
feature-density histogram.

Pure functions of the stored evaluation (`sae_dist.db.evaluations.evaluation_dict`), so what the
page shows is testable with plain data. A value that was not measured reads "—", never 0.
"""

from __future__ import annotations

import math
from typing import Any

import altair as alt
import pandas as pd
from sqlalchemy.engine import Engine

from sae_dist.analytics.cards import Card
from sae_dist.analytics.chart_stack import fit_width
from sae_dist.format import MISSING, fmt_number, fmt_percent, fmt_time

NEVER_LABEL = "never fired"
NEVER_COLOR = "#d62728"  # dead latents stand out from the live ones (Streamlit's blue)
FIRED_COLOR = "#1f77b4"
CHART_HEIGHT = 220  # the plot alone (fit_width): as tall as the training curves
# Where the rows came from, by the evaluation's origin: the trainer evaluates rows it never
# trained on (a shard source's held-out tail, other sources the rows after its last); the
# evaluate command reads the last rows of the shards it is given.
ROWS_FROM = {"heldout": ("rows held out and never trained on (the shards' tail; for other sources, rows after "
                         "the last one trained on)"),
             "cli": "last rows of the shards (python -m sae_dist evaluate)"}


def latest_evaluation(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The run's latest evaluation as a plain dict (Evaluation.to_dict() plus id, created_at,
    sae_path, data_path, where), or None when it has none."""
    from sae_dist.db.evaluations import evaluation_dict, latest_evaluation_for_run

    row = latest_evaluation_for_run(engine, run_id)
    return None if row is None else evaluation_dict(row)


def _get(d: dict[str, Any] | None, key: str) -> Any:
    value = (d or {}).get(key)
    return None if isinstance(value, float) and not math.isfinite(value) else value


def evaluation_cards(ev: dict[str, Any]) -> list[Card]:
    return [
        Card("FVU", fmt_number(_get(ev, "fvu")), "Fraction of variance unexplained: squared error "
             "over the rows' variance about their mean (0 is perfect)."),
        Card("Explained variance", fmt_percent(_get(ev, "explained_variance")), "1 − FVU."),
        Card("L0", fmt_number(_get(ev, "l0"), 3), "Mean number of active latents per row."),
        Card("Dead latents", fmt_percent(_get(ev, "dead_fraction")), "Latents that never fired on these rows."),
        Card("Dense latents", fmt_percent(_get(ev, "dense_fraction")), "Latents firing on more than 10% of the rows."),
    ]


def recovery_cards(ev: dict[str, Any]) -> list[list[Card]]:
    """Planted-dictionary recovery as two rows of cards, all planted features then the rarest
    tenth (no rows when the data was not planted)."""
    rec = ev.get("recovery")
    if not rec:
        return []
    rare = f"the rarest tenth of the planted features ({_count(_get(rec, 'rare_features'))})"
    return [[
        Card("Mean best cosine", fmt_number(_get(rec, "mean_best_cos"), 3),
             f"Over {_count(_get(rec, 'features'))} planted features: each one's best cosine with any decoder row."),
        Card("Recovered > 0.9", fmt_percent(_get(rec, "frac_above_0_9")),
             "Planted features with a best cosine over 0.9."),
        Card("Recovered > 0.8", fmt_percent(_get(rec, "frac_above_0_8")),
             "Planted features with a best cosine over 0.8."),
    ], [
        Card("Rarest tenth: mean best cosine", fmt_number(_get(rec, "rare_mean_best_cos"), 3), f"Over {rare}."),
        Card("Rarest tenth: > 0.9", fmt_percent(_get(rec, "rare_frac_above_0_9")), f"Over {rare}."),
        Card("Rarest tenth: > 0.8", fmt_percent(_get(rec, "rare_frac_above_0_8")), f"Over {rare}."),
    ], *matching_cards(rec)]


def matching_cards(rec: dict[str, Any]) -> list[list[Card]]:
    """MCC and a hierarchy's parents and children, as a row of cards; none where neither was
    measured (evaluations stored before them, or too big to match)."""
    row = []
    if _get(rec, "mcc") is not None:
        row.append(Card("MCC", fmt_number(_get(rec, "mcc"), 3),
                        "Mean |cosine| of the one-to-one matching of planted features to latents that "
                        "maximises it (SAELens' synthetic benchmark's MCC)."))
    if _get(rec, "f1") is not None:
        row.append(Card("Detector F1", fmt_number(_get(rec, "f1"), 3),
                        f"Each latent as a detector of its best-matching planted feature, over these rows: mean "
                        f"precision {fmt_number(_get(rec, 'precision'), 3)}, recall "
                        f"{fmt_number(_get(rec, 'recall'), 3)}, F1 (SAELens' synthetic evals)."))
    if _get(rec, "uniqueness") is not None:
        row.append(Card("Uniqueness", fmt_number(_get(rec, "uniqueness"), 3),
                        "The distinct planted features that are some latent's best match, over the number of "
                        "latents: 1 when each latent tracks a feature of its own (SAELens' synthetic evals)."))
    if _get(rec, "latents_on_a_feature") is not None:
        row.append(Card("Latents on a feature", fmt_percent(_get(rec, "latents_on_a_feature")),
                        "Of the latents that fired on these rows, those whose best |cosine| with a planted "
                        f"feature is over 0.9 ({fmt_percent(_get(rec, 'firings_on_a_feature'))} of the firings); "
                        f"mixed, 0.5 to 0.9: {fmt_percent(_get(rec, 'latents_mixed'))} "
                        f"({fmt_percent(_get(rec, 'firings_mixed'))} of the firings); on none: "
                        f"{fmt_percent(_get(rec, 'latents_on_none'))} "
                        f"({fmt_percent(_get(rec, 'firings_on_none'))})."))
    if _get(rec, "parents"):
        row.append(Card("Parents > 0.9", fmt_percent(_get(rec, "parents_frac_above_0_9")),
                        f"The hierarchy's {_count(_get(rec, 'parents'))} parent features with a best cosine over "
                        "0.9: a parent absorbed into its children's latents is not."))
        row.append(Card("Children > 0.8", fmt_percent(_get(rec, "children_frac_above_0_8")),
                        "The features that fire only with their parent, with a best cosine over 0.8."))
        if _get(rec, "parent_in_children") is not None:
            row.append(Card("Parent in children's latents", fmt_number(_get(rec, "parent_in_children"), 3),
                            "Absorption: the mean cosine between each child's best-matching latent and its "
                            f"parent (about 0 when the child's latent is its own); "
                            f"{fmt_percent(_get(rec, 'absorbed_parents'))} of the parents have no latent "
                            "of their own" + _absorbed_or_hedged(rec)))
        if _get(rec, "children_in_parents") is not None:
            row.append(Card("Children in parents' latents", fmt_number(_get(rec, "children_in_parents"), 3),
                            "The other way: the mean cosine between each parent's best-matching latent and "
                            "its children's mean direction (about 0 when the parent's latent is its own; a "
                            "Matryoshka inner prefix pulls it toward the parent plus its children's mean)."))
    return [row] if row else []


def _absorbed_or_hedged(rec) -> str:
    in_child = _get(rec, "parents_in_a_childs_latent")
    if in_child is None:
        return "."
    return (f": {fmt_percent(in_child)} in a child's latent (absorbed), "
            f"{fmt_percent(_get(rec, 'absorbed_parents') - in_child)} in a latent no child shares (hedged, "
            "or not found).")


# SAEBench's core metrics (sae_dist.evaluate.metrics.core_metrics), in its names, with a line each.
CORE_METRICS = {
    "explained_variance": "1 - E||x - x_hat||^2 / Var(x)",
    "mse": "mean over rows of the summed squared error",
    "cossim": "mean cosine of x and x_hat",
    "l2_norm_in": "mean ||x||", "l2_norm_out": "mean ||x_hat||",
    "l2_ratio": "mean ||x_hat|| / ||x||: under 1 is shrinkage",
    "relative_reconstruction_bias": "E||x_hat||^2 / E[x . x_hat] (Gao et al.): 1 is unbiased",
    "l0": "mean active latents per row", "l1": "mean summed latent activations per row",
    "frac_alive": "latents that fired at least once",
    "freq_over_1_percent": "latents firing on more than 1% of the rows",
    "freq_over_10_percent": "latents firing on more than 10% of the rows",
}


def core_table(ev: dict[str, Any]) -> list[dict[str, str]]:
    """The evaluation's SAEBench core metrics as table rows (none for evaluations stored before
    them)."""
    core = ev.get("core") or {}
    return [{"Metric": name, "Value": fmt_number(_get(core, name), 4), "What it is": what}
            for name, what in CORE_METRICS.items() if name in core]


def model_check_cards(check: dict[str, Any] | None) -> list[Card]:
    """The model check's figures (empty when there is none, or it could not run)."""
    kind = (check or {}).get("kind")
    if kind == "sentence_cosine":
        return [
            Card("Sentence cosine, SAE spliced", fmt_number(_get(check, "spliced_cosine"), 4),
                 "Mean cosine between the model's sentence embedding with the SAE's reconstruction "
                 "at the site and without (1 is perfect)."),
            Card("Sentence cosine, site zeroed", fmt_number(_get(check, "ablated_cosine"), 4),
                 "The same with the site's output replaced by zeros: the scale of the figure above."),
        ]
    if kind == "ce_loss_score":
        return [
            Card("CE loss score", fmt_number(_get(check, "ce_loss_score"), 4),
                 "(CE zeroed − CE spliced) / (CE zeroed − CE clean), as SAELens defines it: 1 when "
                 "the splice costs nothing, 0 when it is as bad as zeroing the site."),
            Card("CE clean", fmt_number(_get(check, "ce_clean"), 4), "Next-token cross-entropy (nats) of the model."),
            Card("CE spliced", fmt_number(_get(check, "ce_spliced"), 4), "With the SAE's reconstruction at the site."),
            Card("CE site zeroed", fmt_number(_get(check, "ce_ablated"), 4), "With the site's output zeroed."),
            *([Card("KL div score", fmt_number(_get(check, "kl_div_score"), 4),
                    "(KL zeroed − KL spliced) / KL zeroed, SAEBench's: KL is the mean over positions of "
                    "KL(clean next-token distribution ‖ the other); 1 when the splice changes nothing."),
               Card("KL spliced", fmt_number(_get(check, "kl_div_with_sae"), 4),
                    "Mean KL (nats) of the clean model's next-token distribution from the spliced one's."),
               Card("KL site zeroed", fmt_number(_get(check, "kl_div_with_ablation"), 4),
                    "The same with the site's output zeroed.")]
              if "kl_div_score" in check else []),  # checks stored before the KL scores have none
        ]
    return []


def model_check_caption(check: dict[str, Any] | None) -> str:
    """What the model check ran on, or why there is none."""
    if not check:
        return ("No model check: the rows were not harvested from a model (or the evaluation "
                "did not run one).")
    if check.get("kind") == "unavailable":
        return f"The model check could not run: {check.get('reason') or MISSING}"
    where = f"{check.get('model') or MISSING}, layer {_count(check.get('layer'))}, site {check.get('site') or MISSING}"
    seen = {"not harvested": "text the harvest did not use",
            "harvested": "harvested text (none was left unused), which the SAE may have trained on",
            "text changed since the harvest": "the harvest's text files as they are now (changed since)"}
    source = seen.get(check.get("texts_from"), check.get("texts_from") or MISSING)
    return (f"The SAE spliced into {where}, on {_count(check.get('texts'))} contexts "
            f"({_count(check.get('tokens'))} tokens) of {source}.")


def rows_caption(ev: dict[str, Any]) -> str:
    where = ROWS_FROM.get(ev.get("where"), ev.get("where") or MISSING)
    return (f"On {_count(ev.get('rows'))} {where}; data `{ev.get('data_path') or MISSING}`, "
            f"SAE `{ev.get('sae_path') or MISSING}`, evaluated {fmt_time(ev.get('created_at'))}.")


def _count(value: Any) -> str:
    return MISSING if value is None else f"{value:,}" if isinstance(value, int) else str(value)


# ---------------------------------------------------------------- the feature-density histogram


def density_frame(density: dict[str, Any] | None, rows: int | None = None) -> pd.DataFrame:
    """One row per bar: never-firing latents first (their own bar), then each bin of log10 firing
    frequency. Bins wholly below 1 / rows (which no latent can reach on these rows) are left out
    unless they hold latents; every other bin is kept, empty or not, so the axis is even."""
    columns = ["bin", "range", "low", "high", "latents", "kind", "order"]
    if not density or not density.get("edges"):
        return pd.DataFrame(columns=columns)
    edges, counts = density["edges"], density["counts"]
    lowest = math.log10(1 / rows) if rows else -math.inf
    records = [{"bin": NEVER_LABEL, "range": "0 (never fired)", "low": None, "high": None,
                "latents": int(density.get("never") or 0), "kind": NEVER_LABEL, "order": 0}]
    for i, count in enumerate(counts):
        low, high = edges[i], edges[i + 1]
        if high <= lowest and not count:
            continue
        # Short labels (the bin's lower edge) stay level and legible; the tooltip gives the range.
        records.append({"bin": f"{low:g}", "range": f"10^{low:g} to 10^{high:g}", "low": low, "high": high,
                        "latents": int(count), "kind": "fired", "order": i + 1})
    return pd.DataFrame.from_records(records, columns=columns)


def density_chart(density: dict[str, Any] | None, rows: int | None = None) -> alt.Chart | None:
    """Latents per bin of log10 firing frequency, with the never-firing ones as a labelled bar
    of their own at the left (log10 of 0 has no place on the axis); None without a histogram."""
    frame = density_frame(density, rows)
    if frame.empty:
        return None
    never = int(frame.loc[frame["kind"] == NEVER_LABEL, "latents"].sum())
    total = int(frame["latents"].sum())
    # No legend: the never-firing bar is named on the axis, and its colour only sets it apart.
    return fit_width(alt.Chart(frame).mark_bar().encode(
        x=alt.X("bin:N", sort=list(frame["bin"]), title="log10 firing frequency (bin's lower edge)",
                axis=alt.Axis(labelAngle=0)),
        y=alt.Y("latents:Q", title="Latents"),
        color=alt.Color("kind:N", scale=alt.Scale(domain=["fired", NEVER_LABEL], range=[FIRED_COLOR, NEVER_COLOR]),
                        legend=None),
        tooltip=[alt.Tooltip("range:N", title="Firing frequency"),
                 alt.Tooltip("latents:Q", title="Latents", format=",")],
    ).properties(title=alt.TitleParams("Feature density", subtitle=f"{never:,} of {total:,} latents never fired"),
                 height=CHART_HEIGHT))

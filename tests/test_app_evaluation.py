"""A run's evaluation on the Training runs page (AppTest over a real state database), and the
feature-density chart builder with plain data."""

from __future__ import annotations

import math

import pytest
from streamlit.testing.v1 import AppTest

from conftest import REPO
from sae_dist.analytics import evaluation_view
from sae_dist.db import get_engine
from sae_dist.db.evaluations import record_evaluation
from sae_dist.format import MISSING
from test_app import add_run

RUNS = "pages/4_Training_runs.py"
EDGES = [-8.0 + 0.5 * i for i in range(17)]


@pytest.fixture(autouse=True)
def environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


def density(never: int, **bins: int) -> dict:
    counts = [0] * 16
    for index, count in bins.items():
        counts[int(index.removeprefix("b"))] = count
    return {"edges": EDGES, "counts": counts, "never": never}


def evaluation(**changes) -> dict:
    base = {"rows": 4096, "d_sae": 64, "fvu": 0.125, "explained_variance": 0.875, "mse": 0.5, "cosine": 0.93,
            "l0": 7.5, "dead_fraction": 4 / 64, "dense_fraction": 0.0,
            "density": density(4, b14=20, b15=40), "recovery": None, "model_check": None}
    return {**base, **changes}


def open_runs(run_id: int) -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=30).run()
    at.query_params["run"] = str(run_id)
    at.switch_page(RUNS).run()
    assert not at.exception
    return at


def shown(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def captions(at: AppTest) -> str:
    return "\n".join(c.value for c in at.caption)


def density_chart_spec(at: AppTest) -> str:
    specs = [str(c.proto.spec) for c in at.get("vega_lite_chart")]
    return next((s for s in specs if "Feature density" in s), "")


def test_a_run_without_evaluation_says_so(state_home):
    run_id = add_run(get_engine(), "plain-run", "COMPLETED", [10, 20], 20)
    at = open_runs(run_id)
    assert any(i.proto.title == "No evaluation yet" for i in at.info)
    assert any("`python -m sae_dist evaluate" in m.value for m in at.markdown) and not at.code
    assert "FVU" not in shown(at) and not density_chart_spec(at)


def test_the_latest_evaluation_with_recovery_and_model_check(state_home):
    engine = get_engine()
    run_id = add_run(engine, "evaluated-run", "COMPLETED", [10, 20], 20)
    record_evaluation(engine, evaluation(fvu=0.9), "/runs/x/sae", "/acts", run_id=run_id, where="cli")  # older
    recovery = {"features": 100, "mean_best_cos": 0.91, "frac_above_0_9": 0.8, "frac_above_0_8": 0.95,
                "rare_features": 10, "rare_mean_best_cos": 0.7, "rare_frac_above_0_9": 0.3, "rare_frac_above_0_8": 0.5}
    check = {"kind": "sentence_cosine", "spliced_cosine": 0.9, "ablated_cosine": 0.015, "tokens": 7511,
             "texts": 60, "texts_from": "not harvested", "model": "/models/minilm", "layer": 3, "site": "resid"}
    record_evaluation(engine, evaluation(recovery=recovery, model_check=check, dense_fraction=None),
                      "/runs/x/sae", "/acts", run_id=run_id, where="heldout")
    at = open_runs(run_id)
    cards = shown(at)
    assert cards["FVU"] == "0.125" and cards["Explained variance"] == "87.5%"
    assert cards["L0"] == "7.5" and cards["Dead latents"] == "6.2%"
    assert cards["Dense latents"] == MISSING  # unknown is a dash, never 0
    assert cards["Mean best cosine"] == "0.91" and cards["Recovered > 0.9"] == "80.0%"
    assert cards["Rarest tenth: mean best cosine"] == "0.7" and cards["Rarest tenth: > 0.8"] == "50.0%"
    assert cards["Sentence cosine, SAE spliced"] == "0.9" and cards["Sentence cosine, site zeroed"] == "0.015"
    text = captions(at)
    assert "On 4,096 rows held out and never trained on" in text and "data `/acts`" in text
    assert "60 contexts (7,511 tokens) of text the harvest did not use" in text
    spec = density_chart_spec(at)
    assert "never fired" in spec and "4 of 64 latents never fired" in spec


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_ce_loss_check_and_an_unavailable_one(state_home):
    engine = get_engine()
    run_id = add_run(engine, "lm-run", "COMPLETED", [10], 10)
    check = {"kind": "ce_loss_score", "ce_clean": 3.2, "ce_spliced": 3.5, "ce_ablated": 9.2, "ce_loss_score": 0.95,
             "kl_div_with_sae": 0.1, "kl_div_with_ablation": 4.0, "kl_div_score": 0.975,
             "tokens": 2000, "texts": 16, "texts_from": "harvested", "model": "gpt2", "layer": 6, "site": "resid"}
    record_evaluation(engine, evaluation(model_check=check), "/sae", "/acts", run_id=run_id)
    at = open_runs(run_id)
    cards = shown(at)
    assert (cards["CE loss score"], cards["CE clean"], cards["CE site zeroed"]) == ("0.95", "3.2", "9.2")
    assert (cards["KL div score"], cards["KL spliced"], cards["KL site zeroed"]) == ("0.975", "0.1", "4")
    assert "harvested text (none was left unused)" in captions(at)
    assert "On 4,096 last rows of the shards (python -m sae_dist evaluate)" in captions(at)
    assert "Mean best cosine" not in cards  # not planted: no recovery cards

    record_evaluation(engine, evaluation(model_check={"kind": "unavailable", "reason": "--model m: not on disk"}),
                      "/sae", "/acts", run_id=run_id)
    at = open_runs(run_id)
    assert "The model check could not run: --model m: not on disk" in captions(at)
    assert "CE loss score" not in shown(at)


def test_density_frame_keeps_never_firing_latents_as_their_own_bar():
    frame = evaluation_view.density_frame(density(7, b0=1, b10=3, b15=2), rows=1000)
    assert frame["bin"].iloc[0] == "never fired" and frame["latents"].iloc[0] == 7
    assert frame["latents"].sum() == 13  # every latent is in one bar
    # 1 / 1000 rows is 10^-3: bins wholly below it are dropped, unless they hold latents (b0).
    assert list(frame["bin"].iloc[1:3]) == ["-8", "-3"] and frame["range"].iloc[2] == "10^-3 to 10^-2.5"
    assert frame["bin"].iloc[-1] == "-0.5" and list(frame["order"]) == sorted(frame["order"])
    chart = evaluation_view.density_chart(density(7, b10=3), rows=1000).to_dict()
    assert chart["encoding"]["x"]["sort"][0] == "never fired"
    assert chart["title"]["subtitle"] == "7 of 10 latents never fired"
    assert evaluation_view.density_chart(None) is None
    assert evaluation_view.density_chart({"edges": [], "counts": [], "never": 0}) is None


def test_no_dead_latents_still_draws_an_empty_never_bar():
    frame = evaluation_view.density_frame(density(0, b15=5))
    assert frame["latents"].iloc[0] == 0 and len(frame) == 17  # rows unknown: every bin kept
    assert not any(isinstance(v, float) and math.isnan(v) for v in frame["latents"])


def test_mcc_a_hierarchy_and_the_core_metrics_are_shown(state_home):
    """An evaluation on a planted hierarchy: MCC and its parents and children as cards; SAEBench's
    core metrics, by their names, in a table; stored and read back through the database."""
    engine = get_engine()
    run_id = add_run(engine, "hierarchy-run", "COMPLETED", [10], 10)
    recovery = {"features": 100, "mean_best_cos": 0.91, "frac_above_0_9": 0.8, "frac_above_0_8": 0.95,
                "rare_features": 10, "rare_mean_best_cos": 0.7, "rare_frac_above_0_9": 0.3, "rare_frac_above_0_8": 0.5,
                "mcc": 0.512, "parents": 25, "parents_frac_above_0_9": 0.53, "children_frac_above_0_8": 0.045,
                "precision": 0.6, "recall": 0.8, "f1": 0.686, "accuracy": 0.99, "absorbed_parents": 0.47,
                "parent_in_children": 0.412, "uniqueness": 0.4375, "latents_on_a_feature": 0.37, "latents_mixed": 0.23,
                "latents_on_none": 0.4, "firings_on_a_feature": 0.594, "firings_mixed": 0.397, "firings_on_none": 0.009}
    core = {"explained_variance": 0.875, "mse": 0.5, "cossim": 0.93, "l2_norm_in": 2.0, "l2_norm_out": 1.8,
            "l2_ratio": 0.9, "relative_reconstruction_bias": 0.97, "l0": 7.5, "l1": 12.25, "frac_alive": 0.94,
            "freq_over_1_percent": 0.5, "freq_over_10_percent": 0.0}
    record_evaluation(engine, evaluation(recovery=recovery, core=core), "/runs/h/sae", "/acts", run_id=run_id,
                      where="heldout")
    at = open_runs(run_id)
    cards = shown(at)
    assert cards["MCC"] == "0.512" and cards["Parents > 0.9"] == "53.0%" and cards["Children > 0.8"] == "4.5%"
    assert cards["Detector F1"] == "0.686" and cards["Parent in children's latents"] == "0.412"
    assert cards["Uniqueness"] == "0.438" and cards["Latents on a feature"] == "37.0%"
    (table,) = [d for d in at.dataframe if "Metric" in d.value.columns]
    rows = dict(zip(table.value["Metric"], table.value["Value"]))
    assert rows["relative_reconstruction_bias"] == "0.97" and rows["l1"] == "12.25"
    assert list(table.value["Metric"]) == list(core)  # SAEBench's names, every one


def test_an_evaluation_stored_before_the_core_metrics_shows_none_of_them(state_home):
    engine = get_engine()
    run_id = add_run(engine, "old-run", "COMPLETED", [10], 10)
    record_evaluation(engine, evaluation(), "/runs/o/sae", "/acts", run_id=run_id, where="heldout")
    at = open_runs(run_id)
    assert not [d for d in at.dataframe if "Metric" in d.value.columns] and "MCC" not in shown(at)


def test_the_absorption_card_splits_parents_absorbed_from_hedged():
    """Of the 47% of parents without a latent of their own, 30% sit in a child's latent (absorbed)
    and 17% in a latent no child shares (hedged); an evaluation stored before the split says
    only the first."""
    rec = {"parents": 25, "parents_frac_above_0_9": 0.53, "children_frac_above_0_8": 0.5,
           "absorbed_parents": 0.47, "parent_in_children": 0.412}
    cards = {c.label: c for row in evaluation_view.matching_cards({**rec, "parents_in_a_childs_latent": 0.3})
             for c in row}
    assert cards["Parent in children's latents"].help.endswith(
        "47.0% of the parents have no latent of their own: 30.0% in a child's latent (absorbed), "
        "17.0% in a latent no child shares (hedged, or not found).")
    older = {c.label: c for row in evaluation_view.matching_cards(rec) for c in row}
    assert older["Parent in children's latents"].help.endswith("47.0% of the parents have no latent of their own.")

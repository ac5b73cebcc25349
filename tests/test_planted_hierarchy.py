"""Planted hierarchies (parents, and children that fire only with them) and the figures that judge
an SAE on them: MCC by one-to-one matching and each latent as a detector of its feature (precision,
recall, F1), checked against SAELens' own functions, and the parents' and children's recovery
apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sae_dist.data.sources.synthetic import SyntheticSource
from sae_dist.evaluate.metrics import FiringMatch, latent_census, matching_text, mean_correlation_coefficient, recovery
from sae_dist.evaluate.planted import load_planted, planted_from_settings, presence_frequencies


def coefficients(source: SyntheticSource, rows: int) -> torch.Tensor:
    """Each row's feature coefficients, solved back from noise-free rows (d_in >= features: the
    planted directions are independent, so the solve is exact)."""
    x = source.samples(0, rows).double()
    return torch.linalg.lstsq(source.dictionary.double().T, x.T).solution.T


def test_a_child_fires_only_with_its_parent_and_as_often_as_said():
    source = SyntheticSource(d_in=48, n_features=40, active=2.0, power_law=0.8, noise=0.0, seed=4, rank=0,
                             world_size=1, batch_size=1, children=3, child_prob=0.6, magnitude_sigma=0.5)
    assert (source.parents, source.n_features) == (10, 40)
    a = coefficients(source, 20_000)
    present = a > 1e-6
    parent_of = torch.arange(10).repeat_interleave(3)
    children = present[:, 10:]
    assert children.any() and not (children & ~present[:, parent_of]).any()  # never without the parent
    # The presence the evaluation weighs features by, against the rows: within 2 points each.
    assert torch.allclose(present.double().mean(0), presence_frequencies(source).double(), atol=0.02)
    assert (a[present] > 0).all() and a[present].max() > 2.5  # log-normal: heavier-tailed than [0.5, 2]


@pytest.mark.parametrize("children", [0, 2])
def test_correlated_features_fire_with_their_partner_as_often_as_said(children):
    """Partners (0-1, 2-3, ...; of the parents in a hierarchy) fire together far above chance, the
    presence the evaluation weighs by matches the rows, the codes are the rows' own, and a source
    without correlation is the stream it always was."""
    kw = dict(d_in=48, n_features=33 if not children else 30, active=2.0, power_law=0.3, noise=0.0, seed=5,
              rank=0, world_size=1, batch_size=1, children=children, child_prob=0.5)
    source = SyntheticSource(**kw, correlation=0.7)
    a = coefficients(source, 20_000)
    present = a > 1e-6
    parents = source.parents
    pairs = parents // 2
    first, second = present[:, 0:2 * pairs:2].double(), present[:, 1:2 * pairs:2].double()
    # Given a feature fires, its partner does at least as often as the correlation says (more where
    # the partner was drawn too), and far more often than it fires at all.
    given = (first * second).mean(0) / first.mean(0)
    assert (given > 0.65).all() and (given > second.mean(0) + 0.2).all(), (given, second.mean(0))
    assert torch.allclose(present.double().mean(0), presence_frequencies(source).double(), atol=0.02)
    codes = source.codes(0, 500)
    assert torch.allclose(codes @ source.dictionary, source.samples(0, 500), atol=1e-5)
    plain = SyntheticSource(**kw)
    before = SyntheticSource(**kw, correlation=0.0)
    assert torch.equal(plain.samples(64, 200), before.samples(64, 200))
    if children:  # children still fire only with their parent
        parent_of = torch.arange(parents).repeat_interleave(children)
        assert not (present[:, parents:] & ~present[:, parent_of]).any()


def test_flat_features_and_features_that_do_not_divide_evenly():
    flat = SyntheticSource(d_in=8, n_features=30, active=2.0, power_law=0.5, noise=0.0, seed=1, rank=0,
                           world_size=1, batch_size=1)
    assert (flat.parents, flat.n_features) == (30, 30)
    planted = planted_from_settings(8, 30, 2.0, 0.5, 0.0, 1, children=3)  # 7 parents of 4: 28 features
    assert planted.dictionary.shape[0] == 28 and planted.settings["parents"] == 7
    assert planted.settings["features"] == 28


def test_recovery_of_a_hierarchy_is_said_for_parents_and_children_apart():
    planted = planted_from_settings(256, 12, 2.0, 0.5, 0.0, 2, children=2)  # 4 parents, 8 children
    dictionary = planted.dictionary  # 256 wide: nearly orthogonal, so a child plus a parent is at ~0.7 of each
    decoder = torch.cat([dictionary[:4], dictionary[4:8] + dictionary[:4], dictionary[8:]])
    found = recovery(dictionary, planted.frequencies, decoder, parents=4).to_dict()
    assert found["parents"] == 4 and found["parents_frac_above_0_9"] == 1.0
    assert found["children_frac_above_0_8"] == 0.5  # 4 of 8 absorbed their parent, cosine about 0.7
    assert matching_text(found).startswith("MCC 0.")
    assert "parents 100.0% at cos > 0.9, children 50.0% at cos > 0.8" in matching_text(found)
    flat = recovery(dictionary, planted.frequencies, dictionary).to_dict()
    assert flat["mcc"] == pytest.approx(1.0) and "parents" not in flat  # not measured: absent
    assert mean_correlation_coefficient(dictionary, -dictionary.flip(0)) == pytest.approx(1.0)  # |cos|, any order


def test_make_planted_writes_a_hierarchy(cli, tmp_path):
    code, out, err = cli("make-planted", str(tmp_path / "h"), "--rows", "300", "--d-in", "16", "--features", "24",
                         "--children", "2", "--child-prob", "0.9", "--magnitude-sigma", "0.3")
    assert code == 0, err
    assert "2 children a parent" in out
    planted = load_planted(tmp_path / "h")
    assert planted.settings | {"parents": 8, "children": 2, "child_prob": 0.9, "magnitude_sigma": 0.3} \
        == planted.settings
    assert planted.dictionary.shape == (24, 16)
    code, out, err = cli("make-planted", str(tmp_path / "c"), "--rows", "300", "--d-in", "16", "--features", "24",
                         "--correlation", "0.4")
    assert code == 0, err
    correlated = load_planted(tmp_path / "c")
    assert correlated.settings["correlation"] == 0.4
    truth = SyntheticSource(d_in=16, n_features=24, active=4.0, power_law=0.5, noise=0.01, seed=0, rank=0,
                            world_size=1, batch_size=1, correlation=0.4)
    assert torch.equal(correlated.truth(10, 20), truth.codes(10, 20))  # the ground truth evaluate judges by


@pytest.mark.parametrize("flag, value, words", [("--children", "-1", "children -1: must be 0 or a positive"),
                                                ("--child-prob", "1.5", "child-prob 1.5: must be between 0 and 1"),
                                                ("--magnitude-sigma", "-0.1", "magnitude-sigma -0.1: must be 0"),
                                                ("--correlation", "1.2", "correlation 1.2: must be between 0 and 1"),
                                                ("--children", "40", "features 24: too few for one parent")])
def test_make_planted_refuses_a_bad_hierarchy_in_one_line(cli, tmp_path, flag, value, words):
    code, out, err = cli("make-planted", str(tmp_path / "h"), "--rows", "10", "--d-in", "4", "--features", "24",
                         flag, value)
    assert code != 0 and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "h").exists()


# ---- against SAELens' own synthetic-benchmark metric -------------------------------------------

SAELENS_SCRIPT = r"""
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from sae_lens.synthetic.evals import compute_classification_metrics, feature_uniqueness, mean_correlation_coefficient

root = Path(sys.argv[1])
t = load_file(str(root / "features.safetensors"))
out = {name: mean_correlation_coefficient(t["decoder_" + name], t["truth"]) for name in ("wide", "narrow", "same")}
out["uniqueness"] = {name: feature_uniqueness(t["decoder_" + name], t["truth"]) for name in ("wide", "narrow", "same",
                                                                                           "repeated")}
m = compute_classification_metrics(t["latents"], t["codes"], t["decoder_wide"], t["truth"])
out["classification"] = {"precision": m.precision, "recall": m.recall, "f1": m.f1_score, "accuracy": m.accuracy}
(root / "mcc.json").write_text(json.dumps(out))
"""


def matching_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    truth = torch.randn(40, 12, generator=g)
    noisy = truth + 0.4 * torch.randn(40, 12, generator=g)
    codes = torch.relu(torch.randn(200, 40, generator=g) - 1.0)  # which features fire in 200 rows
    latents = torch.relu(torch.randn(200, 65, generator=g) - 0.8)  # and which latents
    latents[:, :40] += codes  # the matched ones mostly with their feature
    return {"truth": truth, "decoder_same": noisy, "decoder_wide": torch.cat([noisy, torch.randn(25, 12, generator=g)]),
            "decoder_narrow": noisy[:30].clone(), "decoder_repeated": torch.cat([noisy, -noisy[:20]]),  # 20 twice
            "codes": codes, "latents": latents}


def prepare_saelens(root: Path) -> tuple[str, list]:
    """Fixed features and decoders for SAELens' MCC, run in the one sae-lens process of the session."""
    save_file(matching_inputs(), str(root / "features.safetensors"))
    return SAELENS_SCRIPT, [root]


@pytest.mark.slow
@pytest.mark.saelens
def test_mcc_is_saelens_own_within_1e_4(tmp_path_factory):
    from saelens_once import saelens_folder

    root = saelens_folder("synthetic", tmp_path_factory)
    theirs = json.loads((root / "mcc.json").read_text())
    t = load_file(str(root / "features.safetensors"))
    for name in ("wide", "narrow", "same"):
        assert mean_correlation_coefficient(t["truth"], t["decoder_" + name]) == pytest.approx(theirs[name], abs=1e-4)
    match = FiringMatch(t["decoder_wide"], t["truth"])
    match.add(t["latents"], t["codes"])
    assert match.result() == pytest.approx(theirs["classification"], abs=1e-4)
    for name, value in theirs["uniqueness"].items():
        assert latent_census(t["truth"], t["decoder_" + name], None) == {"uniqueness": pytest.approx(value, abs=1e-4)}
    assert theirs["uniqueness"]["repeated"] == pytest.approx(40 / 60)  # the case it tells: 20 latents track twice


def test_absorption_says_which_parents_lost_their_latent_and_what_the_children_carry():
    """Parent 0 has no latent of its own: its two children's latents carry it (cosine about 0.71
    each, the directions being nearly orthogonal in 256 dimensions); parent 1 and its children
    keep their own latents (about 0)."""
    planted = planted_from_settings(256, 6, 2.0, 0.5, 0.0, 4, children=2)  # parents 0, 1; children 2-3, 4-5
    d = planted.dictionary
    stranger = torch.randn(256, generator=torch.Generator().manual_seed(9))
    decoder = torch.stack([stranger, d[1], d[2] + d[0], d[3] + d[0], d[4], d[5]])
    found = recovery(d, planted.frequencies, decoder, parents=2).to_dict()
    assert found["absorbed_parents"] == 0.5
    assert found["parent_in_children"] == pytest.approx((2 * 0.5**0.5) / 4, abs=0.05)
    assert "absorption: children's latents carry their parent at cos 0.3" in matching_text(found)
    # Parent 1's latent is its own (about 0); parent 0's best is child 2's latent, which carries half
    # of its children's mean direction (cos 1/2).
    assert found["children_in_parents"] == pytest.approx((0.5 + 0) / 2, abs=0.05)
    assert found["parents_in_a_childs_latent"] == 0.5  # parent 0 lives in child 2's latent: absorbed
    said = "parents without a latent of their own: 50.0% (50.0% in a child's latent, 0.0% in a latent no child"
    assert said in matching_text(found)
    clean = recovery(d, planted.frequencies, d, parents=2).to_dict()
    assert clean["absorbed_parents"] == 0.0 and clean["parent_in_children"] < 0.15
    assert clean["children_in_parents"] < 0.15 and clean["parents_in_a_childs_latent"] == 0.0


def test_a_parent_latent_mixed_with_its_childrens_mean_is_measured():
    """Parent 0's latent is the parent plus its two children's mean, as a Matryoshka inner prefix
    pulls it: its cosine with the children's mean direction is about 1/sqrt(3) (the three unit
    directions nearly orthogonal in 256 dimensions), and it no longer counts as recovered."""
    planted = planted_from_settings(256, 6, 2.0, 0.5, 0.0, 4, children=2)
    d = planted.dictionary
    mixed = d.clone()
    mixed[0] = d[0] + (d[2] + d[3]) / 2
    found = recovery(d, planted.frequencies, mixed, parents=2).to_dict()
    assert found["children_in_parents"] == pytest.approx((3**-0.5 + 0) / 2, abs=0.05)
    assert found["parents_frac_above_0_9"] == 0.5  # cos(p, p + mean of two children) = sqrt(2/3) = 0.82
    assert "parents' latents carry their children's mean at cos 0.2" in matching_text(found)
    # Hedged, not absorbed: the parent's latent is its own (no child's best), only mixed.
    assert found["absorbed_parents"] == 0.5 and found["parents_in_a_childs_latent"] == 0.0


def test_the_latent_census_sorts_the_latents_that_fired_by_what_they_match():
    """Of five latents that fired (the sixth, child 4's, did not): parent 1's and child 5's are on
    one feature, the two children's latents that absorbed parent 0 are mixed (cosine about 0.71
    with each), and a random direction is on none (its best cosine in 256 dimensions about 0.2)."""
    planted = planted_from_settings(256, 6, 2.0, 0.5, 0.0, 4, children=2)
    d = planted.dictionary
    stranger = torch.randn(256, generator=torch.Generator().manual_seed(9))
    decoder = torch.stack([stranger, d[1], d[2] + d[0], d[3] + d[0], d[4], d[5]])
    fired = torch.tensor([1, 10, 20, 20, 0, 49])
    found = recovery(d, planted.frequencies, decoder, parents=2, fired=fired).to_dict()
    assert (found["latents_on_a_feature"], found["latents_mixed"], found["latents_on_none"]) == (0.4, 0.4, 0.2)
    assert (found["firings_on_a_feature"], found["firings_mixed"], found["firings_on_none"]) == \
        pytest.approx((0.59, 0.40, 0.01))
    assert 4 / 6 <= found["uniqueness"] <= 5 / 6  # the two mixed latents may both match parent 0
    assert ("latents that fired: 40.0% on one feature (cos > 0.9; 59.0% of firings), 40.0% mixed (0.5-0.9; "
            "40.0% of firings), 20.0% on none (1.0% of firings)") in matching_text(found)
    # Without firings (a run's checkpoint recovery) or with none, only the uniqueness is measured.
    assert set(recovery(d, planted.frequencies, decoder, fired=None).to_dict()) & {"uniqueness", "latents_mixed"} \
        == {"uniqueness"}
    assert "latents_mixed" not in recovery(d, planted.frequencies, decoder, fired=torch.zeros(6)).to_dict()
    assert recovery(d, planted.frequencies, d, fired=torch.ones(6)).to_dict()["latents_on_a_feature"] == 1.0

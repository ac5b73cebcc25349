"""The SAE evaluator: hand-computed metrics, streaming, our export against the in-memory SAE and
against the real sae-lens, planted shards, the CLI end to end and its bad inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sae_dist.errors import DataError, UserError
from sae_dist.evaluate import (
    DENSITY_EDGES,
    Planted,
    density_histogram,
    evaluate_sae,
    heldout_batches,
    heldout_rows,
    load_planted,
    load_sae,
    planted_from_settings,
    recovery,
    write_planted_shards,
)
from sae_dist.export import export_saelens
from sae_dist.sae import SparseAutoencoder
from sae_dist.sources.shards import write_shards
from sae_dist.sources.synthetic import SyntheticSource

ARCHS = ["topk", "standard", "jumprelu", "batchtopk"]
D_IN, D_SAE, K = 16, 64, 4
SAELENS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-saelens" / "bin" / "python"


def write_sae(path: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    """An SAE folder written by hand, the way SAELens lays it out."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "sae_weights.safetensors"))
    return path


def some_sae(arch: str, seed: int = 0) -> SparseAutoencoder:
    """A small SAE with nonzero biases and thresholds, so that every path of encode matters."""
    sae = SparseAutoencoder(D_IN, D_SAE, arch, k=K, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        sae.W_enc.add_(0.2 * torch.randn(D_IN, D_SAE, generator=g))
        sae.b_enc.copy_(0.1 * torch.randn(D_SAE, generator=g))
        sae.b_dec.copy_(0.3 * torch.randn(D_IN, generator=g))
        if arch == "jumprelu":
            sae.log_threshold.copy_(torch.empty(D_SAE).uniform_(math.log(0.05), math.log(0.5), generator=g))
        if arch == "batchtopk":
            sae.topk_threshold.fill_(0.15)
    return sae.eval()


def rows(n: int = 200, seed: int = 5) -> torch.Tensor:
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.5


# ---------------------------------------------------------------- hand-computed cases

# d_in 2, d_sae 3, ReLU, no biases: latent 0 reads x0, latent 1 reads x1, latent 2 reads nothing.
HAND_ROWS = torch.tensor([[1.0, 2.0], [-1.0, 3.0], [2.0, -2.0], [3.0, 1.0]])


@pytest.fixture
def hand_sae(tmp_path) -> Path:
    cfg = {"architecture": "standard", "d_in": 2, "d_sae": 3, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "metadata": {"sae_lens_version": "6.0.0"}}
    return write_sae(tmp_path / "hand", cfg, {
        "W_enc": torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), "b_enc": torch.zeros(3),
        "W_dec": torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]), "b_dec": torch.zeros(2)})


def test_hand_computed_metrics(hand_sae):
    ev = evaluate_sae(load_sae(hand_sae), [HAND_ROWS])
    # x_hat = relu(x): squared errors 0, 1, 4, 0; the mean row is (5/4, 1), so the summed
    # variance is 8.75 + 14 = 22.75.
    assert ev.rows == 4 and ev.d_sae == 3
    assert ev.mse == pytest.approx(5 / 4, abs=1e-12)
    assert ev.fvu == pytest.approx(5 / 22.75, abs=1e-12)
    assert ev.explained_variance == pytest.approx(1 - 5 / 22.75, abs=1e-12)
    assert ev.cosine == pytest.approx((2 + 3 / math.sqrt(10) + 1 / math.sqrt(2)) / 4, abs=1e-7)
    assert ev.l0 == pytest.approx(6 / 4)  # 2 + 1 + 1 + 2 active latents
    assert ev.dead_fraction == pytest.approx(1 / 3)  # latent 2
    assert ev.dense_fraction == pytest.approx(2 / 3)  # latents 0 and 1 fire on 3 of 4 rows
    # log10(3/4) = -0.125 lies in the last bin [-0.5, 0]
    assert ev.density.edges == list(DENSITY_EDGES) and len(ev.density.counts) == 16
    assert ev.density.counts == [0] * 15 + [2] and ev.density.never == 1
    assert ev.recovery is None and ev.model_check is None
    d = ev.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["density"] == {"edges": list(DENSITY_EDGES), "counts": [0] * 15 + [2], "never": 1}


def test_density_histogram_bins():
    # frequencies 2/1000 (log -2.70: bin [-3, -2.5)), 50/1000 (-1.30: [-1.5, -1)), 300/1000
    # (-0.52: [-1, -0.5)), 1 (0: the last bin, closed), and two latents that never fired
    h = density_histogram(torch.tensor([2, 50, 300, 1000, 0, 0, 2]), 1000)
    expected = [0] * 16
    expected[10], expected[13], expected[14], expected[15] = 2, 1, 1, 1
    assert h.counts == expected and h.never == 2
    # below 1e-8 counts in the first bin
    assert density_histogram(torch.tensor([1]), 10**9).counts[0] == 1


def test_dense_is_more_than_a_tenth_exactly():
    # 10 rows: a latent on exactly 1 row (10%) is not dense, on 2 rows it is.
    x = torch.zeros(10, 2)
    x[:, 0] = 1.0
    x[0, 1] = 1.0  # latent 1 fires on one row of ten
    x[1, 1] = 0.0

    class TwoLatents:
        d_sae, d_in = 2, 2
        W_dec = torch.eye(2)

        def encode(self, x):
            return x.relu()

        def decode(self, a):
            return a

    ev = evaluate_sae(TwoLatents(), [x])
    assert ev.dense_fraction == 0.5  # latent 0 (10 of 10) only
    x[2, 1] = 1.0
    assert evaluate_sae(TwoLatents(), [x]).dense_fraction == 1.0


# Planted features on d_in 4 against decoder rows e0, e1, (e2 + e3)/sqrt(2); their best cosines:
_S = math.sqrt(0.5)
PLANTED_BEST = [1.0, 1.0, _S, _S, _S, 1.0, 0.0, 0.6, 0.95, 0.85]


def hand_dictionary() -> tuple[torch.Tensor, torch.Tensor]:
    e = torch.eye(4, dtype=torch.float64)
    feats = [e[0], e[1], e[2], e[3], (e[0] + e[1]) * _S, (e[2] + e[3]) * _S, -e[0],
             0.6 * e[0] + 0.8 * e[2], 0.95 * e[0] + math.sqrt(1 - 0.95**2) * e[3],
             0.85 * e[1] + math.sqrt(1 - 0.85**2) * e[2]]
    decoder = torch.stack([e[0], e[1], (e[2] + e[3]) * _S]) * torch.tensor([[2.0], [0.5], [3.0]])  # norms do not matter
    return torch.stack(feats * 2).float(), decoder.float()


def test_recovery_hand_computed_with_the_rare_tenth():
    dictionary, decoder = hand_dictionary()
    freq = torch.linspace(0.9, 0.5, 20)
    freq[6], freq[18] = 0.01, 0.02  # the two rarest: best cosines 0.0 and 0.95
    r = recovery(dictionary, freq, decoder)
    assert r.features == 20 and r.rare_features == 2
    assert r.mean_best_cos == pytest.approx(sum(PLANTED_BEST) / 10, abs=1e-6)
    assert r.frac_above_0_9 == pytest.approx(0.4) and r.frac_above_0_8 == pytest.approx(0.5)
    assert r.rare_mean_best_cos == pytest.approx(0.475, abs=1e-6)
    assert r.rare_frac_above_0_9 == 0.5 and r.rare_frac_above_0_8 == 0.5
    # equal frequencies: the later features count as the rarer (features 18 and 19: 0.95, 0.85)
    r = recovery(dictionary, torch.ones(20), decoder)
    assert r.rare_mean_best_cos == pytest.approx(0.9, abs=1e-6)
    assert (r.rare_frac_above_0_9, r.rare_frac_above_0_8) == (0.5, 1.0)


def test_recovery_through_evaluate_sae():
    dictionary, decoder = hand_dictionary()

    class Linear:
        d_sae, d_in = 3, 4
        W_dec = decoder

        def encode(self, x):
            return x[:, :3]

        def decode(self, a):
            return torch.cat([a, torch.zeros(a.shape[0], 1)], 1)

    ev = evaluate_sae(Linear(), [torch.randn(8, 4)], Planted(dictionary, torch.ones(20)))
    assert ev.recovery.mean_best_cos == pytest.approx(sum(PLANTED_BEST) / 10, abs=1e-6)
    assert ev.to_dict()["recovery"]["rare_features"] == 2
    with pytest.raises(UserError, match="width"):
        evaluate_sae(Linear(), [torch.randn(8, 4)], Planted(torch.randn(5, 3), torch.ones(5)))


# ---------------------------------------------------------------- streaming, loaders


@pytest.mark.parametrize("arch", ["topk", "jumprelu"])
def test_streaming_in_batches_equals_one_batch(arch):
    sae, x = some_sae(arch), rows(203)
    one = evaluate_sae(sae, [x])
    many = evaluate_sae(sae, [x[i:i + 17] for i in range(0, 203, 17)])
    assert many.rows == one.rows == 203
    assert many.density == one.density and many.dead_fraction == one.dead_fraction
    assert many.dense_fraction == one.dense_fraction and many.l0 == one.l0
    for name in ("fvu", "explained_variance", "mse", "cosine"):
        assert getattr(many, name) == pytest.approx(getattr(one, name), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_our_export_through_our_loader_equals_the_in_memory_sae(arch, tmp_path):
    sae, x = some_sae(arch, seed=ARCHS.index(arch)), rows()
    loaded = load_sae(export_saelens(sae, tmp_path / "sae"))
    assert (loaded.d_in, loaded.d_sae) == (D_IN, D_SAE)
    assert loaded.architecture == ("jumprelu" if arch == "batchtopk" else arch)
    with torch.no_grad():
        torch.testing.assert_close(loaded.decode(loaded.encode(x)), sae.decode(sae.encode(x)), rtol=1e-5, atol=1e-5)
    a, b = evaluate_sae(sae, [x]).to_dict(), evaluate_sae(loaded, [x[:77], x[77:]]).to_dict()
    assert a["density"] == b["density"] and a["l0"] == b["l0"]
    for name in ("fvu", "mse", "cosine", "dead_fraction", "dense_fraction"):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7)


def test_a_constant_row_set_has_no_fvu():
    ev = evaluate_sae(some_sae("topk"), [torch.ones(3, D_IN)])
    assert ev.fvu is None and ev.explained_variance is None and ev.mse > 0
    assert ev.to_dict()["fvu"] is None


def test_bad_rows_refused():
    sae = some_sae("topk")
    with pytest.raises(DataError, match="0 rows"):
        evaluate_sae(sae, [])
    with pytest.raises(DataError, match="d_in=16"):
        evaluate_sae(sae, [torch.randn(4, 8)])
    bad = torch.randn(4, D_IN)
    bad[1, 2] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        evaluate_sae(sae, [bad])


def test_loader_follows_saelens_options(tmp_path):
    """rescale_acts_by_decoder_norm and apply_b_dec_to_input = false, as SAELens computes them."""
    g = torch.Generator().manual_seed(3)
    w = {"W_enc": torch.randn(D_IN, D_SAE, generator=g), "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
         "W_dec": torch.randn(D_SAE, D_IN, generator=g), "b_dec": torch.randn(D_IN, generator=g)}
    x = rows(10)
    cfg = {"architecture": "topk", "d_in": D_IN, "d_sae": D_SAE, "k": K, "rescale_acts_by_decoder_norm": True,
           "apply_b_dec_to_input": False, "normalize_activations": "none"}
    sae = load_sae(write_sae(tmp_path / "t", cfg, w))
    norms = w["W_dec"].norm(dim=-1)
    pre = (x @ w["W_enc"] + w["b_enc"]) * norms
    vals, idx = pre.topk(K, dim=-1)
    acts = torch.zeros_like(pre).scatter_(-1, idx, vals.relu())
    torch.testing.assert_close(sae.encode(x), acts)
    torch.testing.assert_close(sae.decode(acts), (acts / norms) @ w["W_dec"] + w["b_dec"])
    # before SAELens 6: no architecture, TopK through activation_fn
    old = {"d_in": D_IN, "d_sae": D_SAE, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}}
    assert load_sae(write_sae(tmp_path / "old", old, w)).k == 3


@pytest.mark.parametrize("change, message", [
    ({"normalize_activations": "layer_norm"}, "normalize_activations='layer_norm' is not supported"),
    ({"normalize_activations": "expected_average_only_in"}, "normalize_activations"),
    ({"architecture": "gated"}, "architecture 'gated' is not one sae-dist can evaluate"),
    ({"k": 0}, "positive integer k"),
    ({"d_in": 8}, "weight shapes do not match"),
])
def test_loader_refuses_what_it_cannot_evaluate(tmp_path, change, message):
    out = export_saelens(some_sae("topk"), tmp_path / "sae")
    cfg = {**json.loads((out / "cfg.json").read_text()), **change}
    (out / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message):
        load_sae(out)


def test_loader_refuses_bad_folders(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_sae(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not an SAE folder: it has no cfg.json and no sae_weights"):
        load_sae(tmp_path / "empty")
    out = export_saelens(some_sae("topk"), tmp_path / "sae")
    weights = out / "sae_weights.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_sae(out)
    weights.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UserError, match="not a readable safetensors file"):
        load_sae(out)
    weights.write_bytes(good)
    (out / "cfg.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_sae(out)


# ---------------------------------------------------------------- shards: held out, planted


def test_heldout_rows_are_the_tail_of_the_shards(tmp_path):
    data = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    write_shards(tmp_path / "s", [data[:20], data[20:35], data[35:]])
    assert torch.equal(heldout_rows(tmp_path / "s", 22), data[-22:])
    assert torch.equal(heldout_rows(tmp_path / "s", 1000), data)  # all, when fewer
    batches = list(heldout_batches(tmp_path / "s", 22, batch_rows=4))
    assert max(len(b) for b in batches) <= 4 and torch.equal(torch.cat(batches), data[-22:])
    half = torch.randn(30, 3).half()
    write_shards(tmp_path / "h", [half])
    assert torch.equal(heldout_rows(tmp_path / "h", 5), half[-5:].float())
    with pytest.raises(DataError, match="0 rows"):
        heldout_rows(tmp_path / "s", 0)
    with pytest.raises(DataError, match="width 3, but the SAE reads d_in=16"):
        heldout_batches(tmp_path / "s", 5, d_in=16)
    with pytest.raises(DataError, match="does not exist"):
        heldout_rows(tmp_path / "nowhere", 5)


def test_planted_shards_hold_the_synthetic_stream(tmp_path):
    out = write_planted_shards(tmp_path / "p", rows=300, d_in=8, features=32, active=2.0, power_law=1.0,
                               noise=0.02, seed=7, rows_per_shard=128)
    source = SyntheticSource(d_in=8, n_features=32, active=2.0, power_law=1.0, noise=0.02, seed=7,
                             rank=0, world_size=1, batch_size=1)
    assert torch.equal(heldout_rows(out, 300), source.samples(0, 300))
    planted = load_planted(out)
    assert torch.equal(planted.dictionary, source.dictionary)
    assert planted.frequencies.shape == (32,) and (planted.frequencies.diff() < 0).all()  # power law
    assert planted.settings["seed"] == 7 and planted.settings["rows"] == 300
    assert torch.equal(planted_from_settings(8, 32, 2.0, 1.0, 0.02, 7).frequencies, planted.frequencies)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["planted"]["features"] == 32 and len(manifest["shards"]) == 3
    # the presence frequency is that of the source's draw: max_active slots from probs, slot 0
    # always kept, the others with probability active / max_active (checked by drawing so)
    g = torch.Generator().manual_seed(0)
    n, m = 20000, source.max_active
    feats = torch.multinomial(source.probs, n * m, replacement=True, generator=g).view(n, m)
    keep = torch.rand(n, m, generator=g) < source.active / m
    keep[:, 0] = True
    for f in (0, 5, 31):
        seen = ((feats == f) & keep).any(1).float().mean()
        assert seen == pytest.approx(float(planted.frequencies[f]), abs=0.01)
    assert load_planted(tmp_path / "p") is not None
    write_shards(tmp_path / "plain", [torch.randn(10, 8)])
    assert load_planted(tmp_path / "plain") is None
    with pytest.raises(DataError, match="already holds shards"):
        write_planted_shards(out, rows=10, d_in=8, features=4)

"""The SAE evaluator: hand-computed metrics, streaming, our export against the in-memory SAE and
against the real sae-lens, planted shards, the CLI end to end and its bad inputs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sae_dist.data.shard_format import write_shards
from sae_dist.data.sources.synthetic import SyntheticSource
from sae_dist.errors import DataError, UserError
from sae_dist.evaluate import (
    DENSITY_EDGES,
    Planted,
    batch_rows_for,
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
from sae_dist.evaluate.metrics import fvu
from sae_dist.models.export import export_saelens
from sae_dist.models.sae import SparseAutoencoder

ARCHS = ["topk", "standard", "jumprelu", "batchtopk"]
D_IN, D_SAE, K = 16, 64, 4


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


def test_one_batchs_fvu_is_evaluates(hand_sae):
    # the hand case above: x_hat = relu(x), 5 / 22.75, the same as the accumulator's
    assert fvu(HAND_ROWS, HAND_ROWS.relu()) == pytest.approx(5 / 22.75, abs=1e-12)
    assert fvu(HAND_ROWS, HAND_ROWS.relu()) == pytest.approx(evaluate_sae(load_sae(hand_sae), [HAND_ROWS]).fvu,
                                                             abs=1e-12)
    assert fvu(HAND_ROWS, HAND_ROWS) == 0.0
    assert fvu(HAND_ROWS, HAND_ROWS.mean(0).expand_as(HAND_ROWS)) == pytest.approx(1.0, abs=1e-12)


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
    for value in (1.0, 0.1, 0.0):  # 0.1: its mean over 3 rows is not exactly 0.1 in floating point
        ev = evaluate_sae(some_sae("topk"), [torch.full((3, D_IN), value)])
        assert ev.fvu is None and ev.explained_variance is None and ev.mse > 0
        assert ev.to_dict()["fvu"] is None
    assert evaluate_sae(some_sae("topk"), [torch.full((3, D_IN), 0.1), torch.zeros(1, D_IN)]).fvu > 0


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
    assert (batch_rows_for(64), batch_rows_for(2**20), batch_rows_for(2**30)) == (4096, 32, 1)
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


# ---------------------------------------------------------------- the database


RUN = dict(name="topk-test", architecture="topk", config_json="{}", world_size=1, backend="gloo",
           device_ids='["cpu:0"]', host="testhost", run_dir="/runs/a", total_steps=5)


@pytest.mark.slow
def test_migration_from_0007_keeps_old_runs_and_records_evaluations(state_home):
    from alembic import command
    from sqlalchemy import delete, insert, inspect, select

    from sae_dist.db import HEAD_REVISION, TrainingRun, get_engine, get_run
    from sae_dist.db.engine import _create_engine, alembic_config
    from sae_dist.db.evaluations import (
        evaluation_dict,
        evaluations_for_run,
        latest_evaluation_for_run,
        record_evaluation,
        run_for_export,
    )
    from sae_dist.db.schema import utcnow

    url = f"sqlite:///{state_home / 'old.db'}"
    old = _create_engine(url)
    with old.begin() as conn:
        command.upgrade(alembic_config(conn), "0007")
        conn.execute(insert(TrainingRun.__table__), [{**RUN, "status": "COMPLETED", "last_step": 5,
                                                      "created_at": utcnow(), "started_at": utcnow(),
                                                      "export_dir": "/runs/a/sae", "final_fvu": 0.25}])
    assert "evaluations" not in inspect(old).get_table_names()
    old.dispose()

    engine = get_engine(url)  # migrates on first use
    with engine.connect() as conn:
        # every migration after 0007 ran
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == HEAD_REVISION
    run = get_run(engine, 1)
    assert (run.name, run.final_fvu, run.export_dir) == ("topk-test", 0.25, "/runs/a/sae")
    assert evaluations_for_run(engine, 1) == [] and latest_evaluation_for_run(engine, 1) is None

    ev = evaluate_sae(some_sae("topk"), [rows(50)], planted_from_settings(D_IN, 20, 2.0, 0.5, 0.01, 0))
    ev.model_check = {"kl": 0.1}
    assert run_for_export(engine, "/runs/a/sae") == 1 and run_for_export(engine, "/elsewhere/sae") is None
    first = record_evaluation(engine, ev, "/runs/a/sae", "/data", run_id=1, where="heldout")
    second = record_evaluation(engine, ev.to_dict() | {"fvu": float("nan")}, "/runs/a/sae", "/data", run_id=1)
    loose = record_evaluation(engine, ev, "/other/sae", "/data")
    assert [e.id for e in evaluations_for_run(engine, 1)] == [first, second]
    latest = latest_evaluation_for_run(engine, 1)
    assert latest.id == second and latest.origin == "cli" and latest.fvu is None  # NaN stored as NULL
    d = evaluation_dict(evaluations_for_run(engine, 1)[0])
    assert d["where"] == "heldout" and d["rows"] == 50 and d["density"] == ev.to_dict()["density"]
    assert d["recovery"] == ev.to_dict()["recovery"] and d["model_check"] == {"kl": 0.1}
    assert d["fvu"] == pytest.approx(ev.fvu) and d["created_at"].tzinfo is not None
    with pytest.raises(ValueError, match="where"):
        record_evaluation(engine, ev, "/x", "/d", where="elsewhere")
    with engine.begin() as conn:  # the run's evaluations go with it; others stay
        conn.execute(delete(TrainingRun).where(TrainingRun.id == 1))
    from sae_dist.db.schema import SaeEvaluation

    with engine.connect() as conn:
        assert conn.execute(select(SaeEvaluation.id)).scalars().all() == [loose]
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0007")
    assert "evaluations" not in inspect(engine).get_table_names()
    engine.dispose()


# ---------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_cli_make_planted_train_evaluate(tmp_path, cli, state_home):
    from conftest import run_cli
    from sae_dist.db import get_engine
    from sae_dist.db.evaluations import latest_evaluation_for_run

    code, out, _ = cli("make-planted", str(tmp_path / "p"), "--rows", "600", "--d-in", "16", "--features", "32",
                       "--rows-per-shard", "256", "--seed", "3")
    assert code == 0 and "wrote 600 planted rows" in out
    assert load_planted(tmp_path / "p").settings | {"seed": 3, "active": 4.0, "power_law": 0.5} == \
        load_planted(tmp_path / "p").settings  # unset flags took the trainer's defaults
    proc = run_cli("train", "--source", "shards", "--shards-path", str(tmp_path / "p"), "--steps", "3",
                   "--d-sae", "32", "--k", "4", "--batch-size", "64", "--devices", "cpu:1",
                   "--out-dir", str(tmp_path / "run"), "--log-every", "1", "--checkpoint-every", "100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, out, err = cli("evaluate", str(tmp_path / "run" / "sae"), "--shards", str(tmp_path / "p"), "--rows", "200",
                         "--json")
    assert code == 0, err
    result = json.loads(out)  # JSON only
    assert result["rows"] == 200 and result["d_sae"] == 32 and result["l0"] <= 4
    assert result["recovery"]["features"] == 32 and result["recovery"]["rare_features"] == 3
    # the same numbers as the API on the same rows, and the row in the database linked to the run
    planted = load_planted(tmp_path / "p")
    planted.first_row = 400  # the last 200 of 600 rows
    expected = evaluate_sae(load_sae(tmp_path / "run" / "sae"), [heldout_rows(tmp_path / "p", 200)],
                            planted).to_dict()
    assert result["density"] == expected["density"]
    assert result["fvu"] == pytest.approx(expected["fvu"], rel=1e-9)
    assert result["recovery"] == pytest.approx(expected["recovery"], rel=1e-9)
    engine = get_engine()
    from sae_dist.db import find_run_by_dir

    run = find_run_by_dir(engine, str(tmp_path / "run"))
    stored = latest_evaluation_for_run(engine, run.id)
    assert stored.origin == "cli" and stored.rows == 200 and stored.fvu == pytest.approx(result["fvu"])
    # the readable summary, in this process
    code, out, _ = cli("evaluate", str(tmp_path / "run" / "sae"), "--shards", str(tmp_path / "p"), "--no-db")
    assert code == 0
    for text in ("FVU", "explained variance", "L0", "dead latents", "dense latents", "never fired",
                 "planted recovery (32 features)", "rarest tenth (3)",
                 "on the last 60 rows"):  # by default the tail a run holds out: a tenth of 600 rows
        assert text in out
    assert "recorded" not in out and latest_evaluation_for_run(engine, run.id).id == stored.id


@pytest.fixture
def sae_and_shards(tmp_path) -> tuple[Path, Path]:
    sae = export_saelens(some_sae("topk"), tmp_path / "sae")
    write_shards(tmp_path / "s", [rows(40)])
    return sae, tmp_path / "s"


def test_cli_bad_inputs_are_one_line_and_exit_2(tmp_path, cli, sae_and_shards):
    sae, shards = sae_and_shards
    write_shards(tmp_path / "wide", [torch.randn(10, 8)])
    (tmp_path / "notsae").mkdir()
    broken = export_saelens(some_sae("topk"), tmp_path / "broken")
    weights = broken / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    garbage = export_saelens(some_sae("topk"), tmp_path / "garbage")
    (garbage / "sae_weights.safetensors").write_bytes(os.urandom(300))
    nojson = export_saelens(some_sae("topk"), tmp_path / "nojson")
    (nojson / "cfg.json").write_text("architecture: topk\n")
    cases = [
        ((str(tmp_path / "notsae"), "--shards", str(shards)), "is not an SAE folder: it has no cfg.json"),
        ((str(tmp_path / "nothing"), "--shards", str(shards)), "does not exist"),
        ((str(sae), "--shards", str(tmp_path / "wide")), "width 8, but the SAE reads d_in=16"),
        ((str(broken), "--shards", str(shards)), "not a readable safetensors file"),
        ((str(garbage), "--shards", str(shards)), "not a readable safetensors file"),
        ((str(sae), "--shards", str(shards), "--rows", "0"), "at least one row"),
        ((str(sae), "--shards", str(tmp_path / "missing")), "shard directory"),
        ((str(nojson), "--shards", str(shards)), "cfg.json is not valid JSON"),
    ]
    for args, message in cases:
        code, out, err = cli("evaluate", *args, "--no-db")
        assert code == 2, (args, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)
        assert "Traceback" not in err and out == ""
    (tmp_path / "empty").mkdir()
    code, _, err = cli("evaluate", str(sae), "--shards", str(tmp_path / "empty"), "--no-db")
    assert code == 2 and "no .safetensors files" in err
    code, _, err = cli("make-planted", str(shards), "--rows", "10", "--d-in", "16")
    assert code == 2 and "already holds shards" in err
    code, _, err = cli("make-planted", str(tmp_path / "new"), "--rows", "0")
    assert code == 2 and "rows 0: must be a positive integer" in err


@pytest.mark.slow
def test_cli_bad_input_from_a_real_process(tmp_path):
    from conftest import run_cli

    proc = run_cli("evaluate", str(tmp_path), "--shards", str(tmp_path / "s"), "--rows", "5")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path} is not an SAE folder: it has no cfg.json "
                                                f"and no sae_weights.safetensors"]


# ---------------------------------------------------------------- the real SAELens

SAELENS_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig
from sae_lens.saes.jumprelu_sae import JumpReLUTrainingSAE, JumpReLUTrainingSAEConfig
from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig, StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig, TopKTrainingSAE, TopKTrainingSAEConfig

root = Path(sys.argv[1])
x = load_file(str(root / "input.safetensors"))["x"]
d_in, d_sae = x.shape[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
# SAEs of SAELens' own, as save_inference_model (training SAEs) and save_model write them
inference = {
    "lens_topk": TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=5)),
    "lens_batchtopk": BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=5)),
    "lens_standard": StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=d_sae)),
    "lens_jumprelu": JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(d_in=d_in, d_sae=d_sae)),
}
plain = {
    "lens_topk_rescaled": TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=5, rescale_acts_by_decoder_norm=True)),
    "lens_topk_plain": TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=3, apply_b_dec_to_input=False)),
    "lens_layer_norm": StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=d_sae, normalize_activations="layer_norm")),
}
with torch.no_grad():
    for name, sae in {**inference, **plain}.items():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(torch.rand(d_sae, generator=g) * 0.3)
        if hasattr(sae, "topk_threshold"):
            sae.topk_threshold.fill_(0.2)
        if name in inference:
            sae.save_inference_model(str(root / name))
        else:
            sae.save_model(str(root / name))
made = {**inference, **plain}
outs = {}
for name in json.loads((root / "names.json").read_text()) + list(made):
    sae = SAE.load_from_disk(str(root / name), device="cpu")
    sae.eval()
    with torch.no_grad():
        outs[name] = sae.decode(sae.encode(x)).contiguous()
save_file(outs, str(root / "x_hat.safetensors"))
"""


def prepare_saelens(root: Path) -> tuple[str, list]:
    """Our export of every architecture and the input rows, in root: the script that has SAELens
    save SAEs of its own there and reconstruct the rows with all of them, and its arguments
    (tests/saelens_once.py runs it, in the one sae-lens process of the session)."""
    names = []
    for i, arch in enumerate(ARCHS):
        export_saelens(some_sae(arch, seed=30 + i), root / arch)
        names.append(arch)
    save_file({"x": rows(64, seed=9)}, str(root / "input.safetensors"))
    (root / "names.json").write_text(json.dumps(names))
    return SAELENS_SCRIPT, [root, D_SAE]


@pytest.mark.slow
@pytest.mark.saelens
def test_saelens_reconstructs_what_our_loader_does(tmp_path_factory):
    """Our export and SAELens' own saved SAEs, loaded by SAELens and by our loader: the same x_hat."""
    from safetensors.torch import load_file

    from saelens_once import saelens_folder

    tmp_path = saelens_folder("evaluate", tmp_path_factory)
    names = json.loads((tmp_path / "names.json").read_text())
    x = load_file(str(tmp_path / "input.safetensors"))["x"]
    theirs = load_file(str(tmp_path / "x_hat.safetensors"))
    lens = ["lens_topk", "lens_batchtopk", "lens_standard", "lens_jumprelu", "lens_topk_rescaled", "lens_topk_plain"]
    for name in names + lens:
        sae = load_sae(tmp_path / name)
        ours = sae.decode(sae.encode(x))
        assert (ours - x).abs().max() > 1e-3  # not a trivial identity
        torch.testing.assert_close(ours, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
    assert load_sae(tmp_path / "lens_batchtopk").architecture == "jumprelu"
    assert load_sae(tmp_path / "lens_topk_rescaled").rescale_acts_by_decoder_norm
    assert not load_sae(tmp_path / "lens_topk_plain").apply_b_dec_to_input
    with pytest.raises(UserError, match="normalize_activations='layer_norm'"):
        load_sae(tmp_path / "lens_layer_norm")


def test_evaluate_shards_is_the_in_memory_sae_on_the_tail_with_its_planted_dictionary(tmp_path):
    from sae_dist.evaluate import evaluate_shards

    out = write_planted_shards(tmp_path / "p", rows=500, d_in=D_IN, features=40, rows_per_shard=200, seed=2)
    sae = some_sae("batchtopk")
    ev = evaluate_shards(sae, out, 300)
    planted = load_planted(out)
    planted.first_row = 200  # the tail's first row: its ground truth is the stream's rows 200..499
    expected = evaluate_sae(sae, [heldout_rows(out, 300)], planted)
    assert ev.recovery.f1 is not None and 0 <= ev.recovery.precision <= 1
    assert ev.rows == 300 and ev.recovery.features == 40 and ev.recovery.rare_features == 4
    assert ev.density == expected.density and ev.l0 == expected.l0
    assert ev.fvu == pytest.approx(expected.fvu, rel=1e-10) and ev.recovery == expected.recovery

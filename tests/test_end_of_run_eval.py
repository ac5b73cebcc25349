"""Every run ends with an evaluation on rows it never trained on: real runs, real files, the real
state database; the numbers checked against the evaluator run by hand on the same rows."""

from __future__ import annotations

import json

import pytest

from conftest import main_here, run_cli
from sae_dist.config import TrainConfig, build_config
from sae_dist.data.sources.synthetic import SyntheticSource
from sae_dist.evaluate import evaluate_sae, heldout_rows, load_planted, load_sae, planted_from_settings
from sae_dist.evaluate.planted import write_planted_shards

TINY = ["--d-sae", "64", "--k", "4", "--batch-size", "64", "--steps", "6", "--log-every", "3", "--seed", "1",
        "--devices", "cpu:1"]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


@pytest.mark.slow
def test_a_synthetic_run_is_evaluated_on_the_stream_after_its_last_sample(tmp_path):
    settings = dict(d_in=16, features=32, active=4.0, power_law=0.5, noise=0.01, seed=1)
    out = ok(run_cli("train", *TINY, "--d-in", "16", "--synthetic-features", "32", "--eval-rows", "300",
                     "--out-dir", str(tmp_path / "run")))
    assert "evaluation on 300 synthetic rows after the run's last sample: FVU" in out.stdout + out.stderr
    stored = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    # The same numbers by hand: rows 6 x 64 .. 6 x 64 + 300 of the same stream, the same dictionary.
    src = SyntheticSource(d_in=16, n_features=32, active=4.0, power_law=0.5, noise=0.01, seed=1, rank=0,
                          world_size=1, batch_size=64)
    planted = planted_from_settings(**settings)
    planted.first_row = 6 * 64  # the rows' ground truth: each latent judged as a feature detector
    expected = evaluate_sae(load_sae(tmp_path / "run" / "sae"), [src.samples(6 * 64, 300)], planted).to_dict()
    assert {"precision", "recall", "f1", "accuracy"} <= set(stored["recovery"])
    assert stored["rows"] == 300 and stored["which_rows"] == "300 synthetic rows after the run's last sample"
    assert stored["fvu"] == pytest.approx(expected["fvu"], rel=1e-5)
    assert stored["recovery"] == pytest.approx(expected["recovery"], rel=1e-5)
    assert stored["density"]["counts"] == expected["density"]["counts"]

    from sae_dist.db import find_run_by_dir, get_engine
    from sae_dist.db.evaluations import latest_evaluation_for_run

    engine = get_engine()
    run = find_run_by_dir(engine, str(tmp_path / "run"))
    row = latest_evaluation_for_run(engine, run.id)
    assert row.origin == "heldout" and row.rows == 300 and row.fvu == pytest.approx(stored["fvu"])


@pytest.mark.slow
def test_a_shard_run_holds_out_the_tail_and_is_evaluated_on_it(tmp_path):
    write_planted_shards(tmp_path / "p", rows=2000, d_in=16, features=32, seed=2, rows_per_shard=700)
    # In this process (a 1-device run trains in the launcher's own: the same code path); the
    # real process's end-of-run evaluation is the synthetic run's above.
    ok(main_here("train", *TINY, "--source", "shards", "--shards-path", str(tmp_path / "p"), "--no-db",
                  "--out-dir", str(tmp_path / "run")))
    stored = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    assert stored["which_rows"] == "the shards' held-out tail (200 rows no batch drew)"  # a tenth of 2,000
    planted = load_planted(tmp_path / "p")
    planted.first_row = 1800  # the tail's rows are the planted stream's 1,800..1,999: their ground truth
    expected = evaluate_sae(load_sae(tmp_path / "run" / "sae"), [heldout_rows(tmp_path / "p", 200)],
                            planted).to_dict()
    assert stored["fvu"] == pytest.approx(expected["fvu"], rel=1e-5)
    assert stored["recovery"]["features"] == 32
    assert stored["recovery"]["f1"] == pytest.approx(expected["recovery"]["f1"], rel=1e-5)
    assert stored["model_check"] is None  # planted shards: no model to splice into


@pytest.mark.slow
def test_eval_rows_0_means_no_evaluation_and_bad_values_are_one_error(tmp_path):
    # In this process; --eval-rows 0 in real processes: tests/test_balance_train.py's runs.
    ok(main_here("train", *TINY, "--d-in", "16", "--eval-rows", "0", "--no-db", "--out-dir", str(tmp_path / "run")))
    assert not (tmp_path / "run" / "evaluation.json").exists()
    # The refusal through sae_dist.cli.main in this process (a real process's refusal: tests/test_config.py).
    code, _, err = main_here("train", *TINY, "--eval-rows", "-5", "--no-db")
    assert code == 2 and err.strip().splitlines() == ["error: eval_rows: must be non-negative, got -5"]


def test_a_config_stored_before_these_fields_still_loads():
    # A run's config_json from before the rule-based defaults: concrete old values, no eval_rows.
    old = {"architecture": "topk", "d_in": 64, "k": 8, "lr": 4e-4, "lr_warmup_steps": 0, "lr_decay_fraction": 0.0,
           "dead_after_samples": 10_000_000, "steps": 100}
    cfg = build_config(old)
    resolved = cfg.resolved(world_size=2)
    assert (resolved.lr, resolved.lr_warmup_steps, resolved.lr_decay_fraction, resolved.dead_after_samples) == \
        (4e-4, 0, 0.0, 10_000_000)  # what it said is what it keeps
    assert cfg.eval_rows == TrainConfig().eval_rows


def test_held_out_tail_of_the_default_is_a_tenth_at_most():
    from sae_dist.defaults import heldout_rows_of

    assert heldout_rows_of(16384, 2_000) == 200
    assert heldout_rows_of(16384, 10_000_000) == 16384
    assert heldout_rows_of(0, 10_000_000) == 0
    assert heldout_rows_of(16384, 9) == 0  # too small to spare a row

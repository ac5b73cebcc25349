"""A sweep's ends, for real: each SAE evaluated on the rows the sweep never trained on, recorded in
its own run (sae_dist/sweeps/eval.py), and every export loaded by the real SAELens. The 1- and
2-rank grids against SAEs trained alone are in tests/test_sweep_train.py (its shared runs); here
the shard source's held-out tail, --eval-rows 0, and an architecture sweep in SAELens. Each sweep
is tiny and trains in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import main_here
from sae_dist.evaluate import evaluate_sae, heldout_rows, load_planted, load_sae
from sae_dist.evaluate.data import batch_rows_for
from sae_dist.evaluate.planted import write_planted_shards
from test_export import SAELENS_SCRIPT  # loads and runs each export named in names.json

TINY = ["--d-in", "16", "--d-sae", "64", "--batch-size", "64", "--steps", "4", "--log-every", "2", "--seed", "1",
        "--devices", "cpu:1"]
ARCHS = ["topk", "standard", "jumprelu", "batchtopk"]
SAELENS_CLASS = {"topk": "TopKSAE", "standard": "StandardSAE", "jumprelu": "JumpReLUSAE",
                 "batchtopk": "JumpReLUSAE"}


def ok(ran):
    assert ran.returncode == 0, f"exit {ran.returncode}\n{ran.stdout[-2000:]}\n{ran.stderr[-2000:]}"
    return ran


@pytest.mark.slow
def test_a_shard_sweep_evaluates_each_sae_on_the_held_out_tail(tmp_path, monkeypatch):
    shards = tmp_path / "p"
    write_planted_shards(shards, rows=2000, d_in=16, features=32, seed=2, rows_per_shard=700)
    monkeypatch.setenv("SAE_DIST_HOME", str(tmp_path / "home"))
    ran = ok(main_here("train", *TINY[2:], "--source", "shards", "--shards-path", str(shards), "--sweep", "k=2,4",
                       "--out-dir", str(tmp_path / "sw")))
    from sae_dist.db import get_engine
    from sae_dist.db.evaluations import latest_evaluation_for_run
    from sae_dist.db.sweeps import find_sweep_by_dir, sweep_runs

    engine = get_engine()
    runs = sweep_runs(engine, find_sweep_by_dir(engine, str((tmp_path / "sw").resolve())).id)
    assert [r.sweep_point for r in runs] == ["k2", "k4"]
    rows = heldout_rows(shards, 200)  # a tenth of 2,000: the tail no batch drew
    for run in runs:
        stored = json.loads((Path(run.run_dir) / "evaluation.json").read_text())
        assert stored["which_rows"] == "the shards' held-out tail (200 rows no batch drew)"
        sae = load_sae(run.export_dir)
        by_hand = evaluate_sae(sae, rows.split(batch_rows_for(sae.d_sae)), load_planted(shards)).to_dict()
        for key in ("fvu", "mse", "cosine", "l0", "dead_fraction"):
            assert stored[key] == pytest.approx(by_hand[key], rel=1e-5, abs=1e-7), (run.sweep_point, key)
        assert stored["recovery"]["features"] == 32 and stored["model_check"] is None
        row = latest_evaluation_for_run(engine, run.id)
        assert (row.origin, row.rows, row.sae_path) == ("heldout", 200, run.export_dir)
    log = ran.stdout + ran.stderr
    assert log.count("evaluation on the shards' held-out tail (200 rows no batch drew): FVU") == 2


@pytest.mark.slow
def test_eval_rows_0_skips_every_sae_s_evaluation(tmp_path):
    ok(main_here("train", *TINY, "--sweep", "k=2,4", "--eval-rows", "0", "--no-db", "--out-dir", str(tmp_path / "sw")))
    assert sorted(p.name for p in (tmp_path / "sw" / "saes").iterdir()) == ["k2", "k4"]
    assert (tmp_path / "sw" / "saes" / "k2" / "sae" / "cfg.json").is_file()
    assert not list((tmp_path / "sw").rglob("evaluation.json"))


# ---------------------------------------------------------------- the real SAELens



def prepare_saelens(root: Path) -> tuple[str, list]:
    """A sweep of every architecture trained into root (in this process, no evaluation), and the
    script that loads every export of it with the real sae-lens, in the one sae-lens process of the
    session (tests/saelens_once.py runs it)."""
    ok(main_here("train", *TINY, "--k", "4", "--sweep", "architecture=" + ",".join(ARCHS), "--eval-rows", "0",
                 "--no-db", "--out-dir", str(root / "sweep"), env={"SAE_DIST_HOME": str(root / "home")}))
    save_file({"x": torch.randn(40, 16, generator=torch.Generator().manual_seed(7)) * 1.5},
              str(root / "input.safetensors"))
    (root / "names.json").write_text(json.dumps([_export(name) for name in ARCHS]))
    return SAELENS_SCRIPT, [root]  # test_export's: loads and runs each named export


def _export(name: str) -> str:
    return f"sweep/saes/{name}/sae"


@pytest.mark.slow
@pytest.mark.saelens
def test_saelens_loads_every_export_of_a_sweep(tmp_path_factory):
    from saelens_once import saelens_folder

    root = saelens_folder("sweep", tmp_path_factory)
    x = load_file(str(root / "input.safetensors"))["x"]
    outs, classes = load_file(str(root / "saelens_out.safetensors")), json.loads((root / "classes.json").read_text())
    assert classes == {_export(name): SAELENS_CLASS[name] for name in ARCHS}
    for name in ARCHS:
        ours = load_sae(root / "sweep" / "saes" / name / "sae")
        with torch.no_grad():
            enc = ours.encode(x)
            dec = ours.decode(enc)
        assert (enc != 0).any(), name  # a nontrivial comparison
        torch.testing.assert_close(outs[_export(name) + ".encode"], enc, rtol=1e-5,
                                   atol=1e-5 * max(1.0, enc.abs().max().item()))
        torch.testing.assert_close(outs[_export(name) + ".decode"], dec, rtol=1e-5,
                                   atol=1e-5 * max(1.0, dec.abs().max().item()))

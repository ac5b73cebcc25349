"""A sweep trained for real: many SAEs in one job from one stream (sae_dist/train/loop.py).

Each SAE of a sweep must equal the same SAE trained alone (same seed, same global batches), on 1
rank (in this process) and on 2 gloo ranks, both when the SAEs share the devices (3 SAEs on 2
ranks: all-gathered batches) and when each has a device of its own (2 SAEs on 2 ranks). One
module fixture trains everything once; the tests read it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import main_here, run_cli
from sae_dist.models.export import load_sae
from sae_dist.train.checkpoint import WEIGHTS, list_checkpoints

pytestmark = pytest.mark.slow  # every test here reads runs trained by the module fixture

BASE = ["--d-in", "16", "--expansion-factor", "4", "--synthetic-features", "48", "--seed", "3",
        "--log-every", "2", "--steps", "8", "--checkpoint-every", "4", "--lr-warmup-steps", "0"]
LR = "2e-3"


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(run_dir)[-1] / WEIGHTS))


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Alone: k=2, 4, 8 on 1 rank, batch 128. Sweeps of the same global batch: 1 rank (k x lr,
    where lr 1e30 really diverges), 2 ranks shared (3 SAEs), 2 ranks groups (2 SAEs)."""
    root = tmp_path_factory.mktemp("sweeps")
    home = {"SAE_DIST_HOME": str(root / "home")}
    out: dict[str, Path] = {"home": root / "home"}
    for k in ("2", "4", "8"):
        out[f"alone-k{k}"] = root / f"alone-k{k}"
        ok(main_here("train", *BASE, "--k", k, "--lr", LR, "--batch-size", "128", "--devices", "cpu:1", "--no-db",
                      "--out-dir", str(out[f"alone-k{k}"]), env=home))
    out["one"] = root / "one"
    out["one_log"] = ok(main_here("train", *BASE, "--batch-size", "128", "--devices", "cpu:1", "--sweep", "k=2,4,8",
                                   "--sweep", f"lr={LR},1e30", "--out-dir", str(out["one"]), "--name", "sw1", env=home))
    out["shared"] = root / "shared"
    out["shared_log"] = ok(run_cli("train", *BASE, "--lr", LR, "--batch-size", "64", "--devices", "cpu:2", "--no-db",
                                   "--sweep", "k=2,4,8", "--out-dir", str(out["shared"]), env=home))
    out["groups"] = root / "groups"
    out["groups_log"] = ok(run_cli("train", *BASE, "--lr", LR, "--batch-size", "64", "--devices", "cpu:2", "--no-db",
                                   "--sweep", "k=4,8", "--out-dir", str(out["groups"]), env=home))
    # Resume: the 1-rank sweep again from its step-4 checkpoint must end where the straight one did.
    resumed = root / "resumed"
    shutil.copytree(out["one"], resumed)
    for ckpt in [*resumed.glob("checkpoints/step_00000008"), *resumed.glob("saes/*/checkpoints/step_00000008")]:
        shutil.rmtree(ckpt)
    for export in resumed.glob("saes/*/sae"):
        shutil.rmtree(export)
    out["resumed"] = resumed
    ok(main_here("train", *BASE, "--batch-size", "128", "--devices", "cpu:1", "--sweep", "k=2,4,8", "--sweep",
                  f"lr={LR},1e30", "--out-dir", str(resumed), "--resume", "--no-db", env=home))
    return out


@pytest.mark.parametrize("which,points", [
    ("one", {f"k{k}-lr{LR}": k for k in (2, 4, 8)}),
    ("shared", {f"k{k}": k for k in (2, 4, 8)}),
    ("groups", {f"k{k}": k for k in (4, 8)}),
])
def test_each_sae_equals_it_trained_alone(runs, which, points):
    for name, k in points.items():
        diff = rel_diff(weights(runs[which] / "saes" / name), weights(runs[f"alone-k{k}"]))
        assert diff < 1e-5, f"{which} {name}: relative weight difference {diff:.2e}"


def test_placements_are_printed(runs):
    assert "3 SAEs on 2 devices" in runs["shared_log"].stdout or "several per device" in runs["shared_log"].stdout
    # An SAE on a device of its own trains on the whole global batch: shares would change nothing.
    assert "the shares change no device's work, so they stay equal" in runs["groups_log"].stdout
    shared = runs["shared_log"].stdout
    assert "cpu:0:" in shared and "cpu:1:" in shared


def test_resume_equals_straight(runs):
    for name in (f"k{k}-lr{LR}" for k in (2, 4, 8)):
        straight, resumed = runs["one"] / "saes" / name, runs["resumed"] / "saes" / name
        assert rel_diff(weights(resumed), weights(straight)) < 1e-6, name
        assert (resumed / "sae" / "cfg.json").is_file()


def test_a_diverging_sae_stops_alone(runs):
    log = runs["one_log"].stdout
    for k in (2, 4, 8):
        assert f"SAE k{k}-lr1e30 stopped at step 2: NaN or inf in the loss" in log
        assert not (runs["one"] / "saes" / f"k{k}-lr1e30" / "sae").exists()
        assert (runs["one"] / "saes" / f"k{k}-lr{LR}" / "sae" / "cfg.json").is_file()
    assert "3 of 6 SAEs failed" in log


def test_database_rows(runs, monkeypatch):
    monkeypatch.setenv("SAE_DIST_HOME", str(runs["home"]))
    from sae_dist.db import get_engine, step_metrics
    from sae_dist.db.sweeps import find_sweep_by_dir, sweep_runs

    engine = get_engine()
    sweep = find_sweep_by_dir(engine, str(runs["one"].resolve()))
    assert sweep is not None and sweep.name == "sw1" and sweep.status == "COMPLETED"
    assert "3 of 6 SAEs failed" in sweep.error and sweep.world_size == 1
    assert json.loads(sweep.keys_json) == ["k", "lr"]
    placement = json.loads(sweep.placement_json)
    assert placement["mode"] == "shared" and len(placement["saes"]) == 6
    saes = sweep_runs(engine, sweep.id)
    assert [r.sweep_point for r in saes] == [f"k{k}-lr{lr}" for k in (2, 4, 8) for lr in (LR, "1e30")]
    for run in saes:
        assert run.run_dir == str((runs["one"] / "saes" / run.sweep_point).resolve())
        if run.sweep_point.endswith("1e30"):
            assert run.status == "FAILED" and f"SAE {run.sweep_point} stopped at step 2" in run.error
            continue
        assert run.status == "COMPLETED" and run.final_fvu is not None and run.export_dir.endswith("sae")
        assert [m.step for m in step_metrics(engine, run.id)] == [2, 4, 6, 8]


def test_exports_load(runs):
    x = torch.randn(32, 16)
    for d in [*(runs["one"] / "saes").glob("*/sae"), *(runs["shared"] / "saes").glob("*/sae")]:
        sae = load_sae(d)
        assert sae.decode(sae.encode(x)).shape == x.shape


@pytest.mark.parametrize("flags,message", [
    (["--sweep", "kk=4,8"], "unknown setting; did you mean 'k'?"),
    (["--sweep", "k="], "an empty value"),
    (["--k", "8", "--sweep", "k=4,8"], "k is given both as a setting"),
    (["--sweep", "k=" + ",".join(str(i) for i in range(1, 18)),
      "--sweep", "lr=" + ",".join(f"{i}e-4" for i in range(1, 17))],
     "272 SAEs"),
])
def test_bad_sweeps_are_one_error_and_start_nothing(cli, tmp_path, flags, message):
    code, out, err = cli("train", *BASE, "--devices", "cpu:1", "--out-dir", str(tmp_path / "r"), *flags)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_estimate_memory_prints_the_placement(cli):
    code, out, _ = cli("estimate-memory", *BASE, "--devices", "cpu:2", "--sweep", "k=2,4,8")
    assert code == 0 and "3 SAEs: k2, k4, k8" in out and "cpu:0:" in out and "cpu:1:" in out


def test_a_run_toml_sweep_table(cli, tmp_path):
    """A run TOML's [sweep] table of lists, with a --sweep flag replacing one of its lists."""
    toml = tmp_path / "run.toml"
    toml.write_text('d_in = 16\nexpansion_factor = 4\ndevices = "cpu:1"\n\n[sweep]\nk = [2, 4]\nlr = [1e-3, 3e-3]\n')
    code, out, _ = cli("estimate-memory", "--config", str(toml), "--sweep", "lr=5e-4")
    assert code == 0 and "2 SAEs: k2-lr5e-4, k4-lr5e-4" in out, out


@pytest.mark.parametrize("which,points", [
    ("one", {f"k{k}-lr{LR}": k for k in (2, 4, 8)}),  # 1 rank: rank 0 evaluates every SAE
    ("groups", {f"k{k}": k for k in (4, 8)}),  # 2 ranks, an SAE each: the rows sent to rank 1 once
])
def test_each_sae_is_evaluated_as_it_alone(runs, which, points):
    """The end-of-run evaluation of each SAE (sae_dist/sweeps/eval.py) is the one its run alone
    writes: the same unseen rows (the stream's after the last step), the same figures."""
    for name, k in points.items():
        mine = json.loads((runs[which] / "saes" / name / "evaluation.json").read_text())
        alone = json.loads((runs[f"alone-k{k}"] / "evaluation.json").read_text())
        assert mine["which_rows"] == alone["which_rows"] == "16,384 synthetic rows after the run's last sample"
        for key in ("fvu", "mse", "cosine", "l0", "dead_fraction", "dense_fraction"):
            assert mine[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), (which, name, key)
        assert mine["recovery"] == pytest.approx(alone["recovery"], rel=1e-5, abs=1e-7)
        assert mine["density"] == alone["density"] and mine["rows"] == alone["rows"] == 16384
    assert not (runs["one"] / "saes" / "k2-lr1e30" / "evaluation.json").exists()  # it diverged: nothing to evaluate


def test_each_sae_s_evaluation_is_in_its_own_run_row(runs, monkeypatch):
    monkeypatch.setenv("SAE_DIST_HOME", str(runs["home"]))
    from sae_dist.db import get_engine
    from sae_dist.db.evaluations import latest_evaluation_for_run
    from sae_dist.db.sweeps import find_sweep_by_dir, sweep_runs

    engine = get_engine()
    for run in sweep_runs(engine, find_sweep_by_dir(engine, str(runs["one"].resolve())).id):
        row = latest_evaluation_for_run(engine, run.id)
        if run.status == "FAILED":
            assert row is None
            continue
        stored = json.loads((Path(run.run_dir) / "evaluation.json").read_text())
        assert (row.origin, row.rows, row.sae_path) == ("heldout", 16384, run.export_dir)
        assert row.fvu == pytest.approx(stored["fvu"])


@pytest.fixture(scope="module")
def resumed_on_2(runs) -> Path:
    """The 2-rank shared sweep (3 SAEs, leaders on both ranks) again from its step-4 checkpoint."""
    resumed = runs["shared"].parent / "resumed-2"
    shutil.copytree(runs["shared"], resumed)
    for done in [*resumed.glob("checkpoints/step_00000008"), *resumed.glob("saes/*/checkpoints/step_00000008"),
                 *resumed.glob("saes/*/sae"), *resumed.glob("saes/*/evaluation.json")]:
        shutil.rmtree(done) if done.is_dir() else done.unlink()
    ok(run_cli("train", *BASE, "--lr", LR, "--batch-size", "64", "--devices", "cpu:2", "--no-db", "--sweep", "k=2,4,8",
               "--out-dir", str(resumed), "--resume", env={"SAE_DIST_HOME": str(runs["home"])}))
    return resumed


def test_resume_on_2_ranks_equals_straight(runs, resumed_on_2):
    for name in ("k2", "k4", "k8"):
        straight, resumed = runs["shared"] / "saes" / name, resumed_on_2 / "saes" / name
        assert rel_diff(weights(resumed), weights(straight)) < 1e-6, name
        assert rel_diff(load_file(str(resumed / "sae" / "sae_weights.safetensors")),
                        load_file(str(straight / "sae" / "sae_weights.safetensors"))) < 1e-6, name
        mine, before = (json.loads((d / "evaluation.json").read_text()) for d in (resumed, straight))
        assert mine["fvu"] == pytest.approx(before["fvu"], rel=1e-5) and mine["density"] == before["density"]

"""A sweep over the model source's layers: one forward pass hooks every layer the sweep reads
(sae_dist/sources/model.py), and each SAE equals the same SAE trained alone from the model at its
layer (same seed, same global batches), on 1 rank (in this process) and on 2 gloo ranks. The tiny
6-layer BERT of test_harvest, a few steps of a small batch; one module fixture trains it all."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import LENGTH_FREE_SCHEDULE, main_here, run_cli
from test_harvest import minilm, text  # noqa: F401 (fixtures: the tiny model and its text)
from test_sweep_train import ok, rel_diff, weights

pytestmark = pytest.mark.slow  # every test here reads runs trained by the module fixture

LAYERS = (1, 3)
KS = (8, 16)


def flags(minilm: str, text: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--source", "model", "--model-path", minilm, "--text-path", text, "--expansion-factor", "2",
            "--seed", "5", "--steps", "6", "--log-every", "3", "--checkpoint-every", "0", "--lr", "1e-3",
            "--eval-rows", "0", "--no-db", "--out-dir", str(out), *LENGTH_FREE_SCHEDULE, *extra]


@pytest.fixture(scope="module")
def runs(minilm, text, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """Alone: each (layer, k) on 1 rank, batch 32. Sweeps of layers x k with the same global
    batch: on 1 rank (in this process), and on 2 ranks (4 SAEs shared: all-gathered batches)."""
    root = tmp_path_factory.mktemp("model_sweeps")
    home = {"SAE_DIST_HOME": str(root / "home")}
    out: dict[str, Path] = {}
    for layer in LAYERS:
        for k in KS:
            out[f"L{layer}-k{k}"] = root / f"alone-L{layer}-k{k}"
            ok(main_here(*flags(minilm, text, out[f"L{layer}-k{k}"], "--model-layer", str(layer), "--k", str(k),
                                "--batch-size", "32", "--devices", "cpu:1"), env=home))
    sweep = ("--sweep", "model_layer=" + ",".join(map(str, LAYERS)), "--sweep", "k=" + ",".join(map(str, KS)))
    out["one"] = root / "one"
    out["one_log"] = ok(main_here(*flags(minilm, text, out["one"], "--batch-size", "32", "--devices", "cpu:1", *sweep),
                                  env=home))
    out["two"] = root / "two"
    ok(run_cli(*flags(minilm, text, out["two"], "--batch-size", "16", "--devices", "cpu:2", *sweep), env=home,
               timeout=300))
    return out


@pytest.mark.parametrize("which", ["one", "two"])
def test_each_layer_sae_equals_it_trained_alone(runs, which):
    for layer in LAYERS:
        for k in KS:
            name = f"L{layer}-k{k}"
            diff = rel_diff(weights(runs[which] / "saes" / name), weights(runs[name]))
            assert diff < 1e-5, f"{which} {name}: relative weight difference {diff:.2e}"


def test_the_layers_differ_and_the_log_says_one_pass(runs):
    assert rel_diff(weights(runs["one"] / "saes" / "L1-k8"), weights(runs["one"] / "saes" / "L3-k8")) > 1e-2
    assert "4 SAEs from one model stream" in runs["one_log"].stdout


def test_a_layer_the_model_lacks_is_one_error_and_starts_nothing(minilm, text, cli, tmp_path):  # noqa: F811
    code, _, err = cli(*flags(minilm, text, tmp_path / "r", "--devices", "cpu:1", "--sweep", "model_layer=2,9"))
    assert code == 2 and err.count("\n") == 1, err
    assert "L9 (model_layer=9, model_site=resid)" in err and "layer 9: the model has 6 layers (0 to 5)" in err, err
    assert not (tmp_path / "r").exists()
    code, _, err = cli(*flags(minilm, text, tmp_path / "r", "--devices", "cpu:1", "--model-layer", "2",
                              "--sweep", "model_site=resid,embed"))
    assert code == 2 and "model_site" in err and "embed" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()

"""A sweep over the model source's layers: one forward pass hooks every layer the sweep reads
(sae_dist/data/sources/model.py), and each SAE equals the same SAE trained alone from the model at its
layer (same seed, same global batches), on 1 rank (in this process) and on 2 gloo ranks. The tiny
6-layer BERT of test_harvest, a few steps of a small batch; one module fixture trains it all."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from conftest import LENGTH_FREE_SCHEDULE, main_here, run_cli
from test_harvest import text  # noqa: F401 (a fixture: the text; the model's is conftest's)
from test_sweep_train import ok, rel_diff, weights

pytestmark = pytest.mark.slow  # every test here reads runs trained by the module fixture

LAYERS = (1, 3)
KS = (8, 16)


def flags(minilm: str, text: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--source", "model", "--model-path", minilm, "--text-path", text, "--expansion-factor", "2",
            "--seed", "5", "--steps", "6", "--log-every", "3", "--checkpoint-every", "0", "--lr", "1e-3",
            "--eval-rows", "0", "--no-db", "--out-dir", str(out), *LENGTH_FREE_SCHEDULE, *extra]


SWEEP = ("--sweep", "model_layer=" + ",".join(map(str, LAYERS)), "--sweep", "k=" + ",".join(map(str, KS)))


# Three module fixtures, not one: each test's setup (what tests/time_limit.py bounds) pays one or two.
@pytest.fixture(scope="module")
def alone(minilm, text, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """Each (layer, k) trained alone on 1 rank, batch 32 (in this process)."""
    root = tmp_path_factory.mktemp("model_alone")
    out = {}
    for layer in LAYERS:
        for k in KS:
            out[f"L{layer}-k{k}"] = root / f"L{layer}-k{k}"
            ok(main_here(*flags(minilm, text, out[f"L{layer}-k{k}"], "--model-layer", str(layer), "--k", str(k),
                                "--batch-size", "32", "--devices", "cpu:1"), env={"SAE_DIST_HOME": str(root)}))
    return out


@pytest.fixture(scope="module")
def one_rank(minilm, text, tmp_path_factory):  # noqa: F811
    """The layers x k sweep, same global batch, on 1 rank (in this process): its dir and output."""
    root = tmp_path_factory.mktemp("model_sweep1")
    ran = ok(main_here(*flags(minilm, text, root / "run", "--batch-size", "32", "--devices", "cpu:1", *SWEEP,
                              "--eval-rows", "64"),  # each SAE evaluated on its layer's unseen rows
                       env={"SAE_DIST_HOME": str(root)}))
    return root / "run", ran


@pytest.fixture(scope="module")
def two_ranks(minilm, text, tmp_path_factory) -> Path:  # noqa: F811
    """The same on 2 gloo ranks (4 SAEs shared by 2 devices: all-gathered batches)."""
    root = tmp_path_factory.mktemp("model_sweep2")
    ok(run_cli(*flags(minilm, text, root / "run", "--batch-size", "16", "--devices", "cpu:2", *SWEEP),
               env={"SAE_DIST_HOME": str(root)}, timeout=300))
    return root / "run"


def same_as_alone(run: Path, alone: dict[str, Path]) -> None:
    for name, path in alone.items():
        diff = rel_diff(weights(run / "saes" / name), weights(path))
        assert diff < 1e-5, f"{run} {name}: relative weight difference {diff:.2e}"


def test_each_layer_sae_equals_it_trained_alone_on_one_rank(alone, one_rank):
    run, ran = one_rank
    same_as_alone(run, alone)
    assert rel_diff(weights(run / "saes" / "L1-k8"), weights(run / "saes" / "L3-k8")) > 1e-2  # layers differ
    assert "4 SAEs from one model stream" in ran.stdout
    assert "hooks 2 sites in one forward pass (L1 resid, L3 resid)" in ran.stdout + ran.stderr
    for name in alone:
        assert (run / "saes" / name / "evaluation.json").is_file(), name


def test_each_layer_sae_equals_it_trained_alone_on_two_ranks(alone, two_ranks):
    same_as_alone(two_ranks, alone)


def test_a_layer_the_model_lacks_is_one_error_and_starts_nothing(minilm, text, cli, tmp_path):  # noqa: F811
    code, _, err = cli(*flags(minilm, text, tmp_path / "r", "--devices", "cpu:1", "--sweep", "model_layer=2,9"))
    assert code == 2 and err.count("\n") == 1, err
    assert "L9 (model_layer=9, model_site=resid)" in err and "layer 9: the model has 6 layers (0 to 5)" in err, err
    assert not (tmp_path / "r").exists()
    code, _, err = cli(*flags(minilm, text, tmp_path / "r", "--devices", "cpu:1", "--model-layer", "2",
                              "--sweep", "model_site=resid,embed"))
    assert code == 2 and "model_site" in err and "embed" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_one_pass_over_several_sites_gives_each_site_its_own_rows(minilm, text):  # noqa: F811
    """Sites of one block and of an earlier one, hooked together (listed out of depth order): each
    slice is the rows a source of that site alone gives, in the same shuffled order."""
    import torch

    from sae_dist.data.sources.model import ModelSource

    def source(layer, site, sites=None):
        return ModelSource(minilm, layer, site, text, 128, 32, 5, 0, 1, torch.device("cpu"), sites=sites)

    both = source(3, "mlp_out", [(3, "mlp_out"), (1, "attn_out"), (3, "resid")])
    rows = both.next_batch()
    assert rows.shape == (32, 3, 384) and both.site_of(1, "attn_out") == 1
    for layer, site in [(1, "attn_out"), (3, "resid")]:
        alone = source(layer, site)
        assert alone.site_of(layer, site) is None
        assert torch.equal(rows[:, both.site_of(layer, site)], alone.next_batch()), (layer, site)


@contextlib.contextmanager
def model_reads():
    """Each read of a model from disk in the block, as sae_dist.data.harvest.run says it (debug level)."""
    seen: list[str] = []

    class Reads(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, said = Reads(logging.DEBUG), logging.getLogger("sae_dist.data.harvest.run")
    level = said.level
    said.addHandler(handler)
    said.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        said.removeHandler(handler)
        said.setLevel(level)


def test_a_site_sweep_through_the_cli_plans_an_sae_per_site_and_a_bad_site_starts_nothing(minilm, text, cli,  # noqa: F811
                                                                                          tmp_path):
    """`train --sweep model_site=attn_out,mlp_out`: two SAEs, each trained on its own site of one
    forward pass (its checkpoint says which), the model's memory in the placement; a site that is
    not one is one error, exit 2, before the model is read, and no run directory."""
    import json

    run = tmp_path / "run"
    with model_reads() as reads:
        ran = ok(cli("train", "--source", "model", "--model-path", minilm, "--text-path", text, "--expansion-factor",
                     "2", "--k", "8", "--steps", "1", "--batch-size", "8", "--eval-rows", "0", "--checkpoint-every",
                     "0", "--no-db", "--devices", "cpu:1", "--model-layer", "2",
                     "--sweep", "model_site=attn_out,mlp_out",
                     "--out-dir", str(run), env={"SAE_DIST_HOME": str(tmp_path / "home")}))
    # One sweep in one process (cpu:1): its config read once (sites and d_in checked), its weights once.
    assert [m.split(": ")[1] for m in reads if m.startswith(f"reading {minilm}")] == [
        "AutoConfig, AutoTokenizer", "AutoConfig, AutoTokenizer, AutoModel"], reads
    said = ran.stdout + ran.stderr
    assert "2 SAEs from one model stream" in said
    assert "hooks 2 sites in one forward pass (L2 attn_out, L2 mlp_out)" in said
    assert "the model source runs on every device" in said and "x 2 sites" in said  # the placement counts the model
    for site in ("attn_out", "mlp_out"):
        meta = json.loads(next((run / "saes" / site / "checkpoints").glob("step_*/meta.json")).read_text())["config"]
        assert (meta["model_layer"], meta["model_site"]) == (2, site), meta
    code, out, err = cli("train", "--source", "model", "--model-path", minilm, "--text-path", text,
                         "--devices", "cpu:1", "--no-db", "--sweep", "model_site=attn_out,mlp",
                         "--out-dir", str(tmp_path / "bad"))
    assert code == 2 and err.count("\n") == 1, err
    assert "model_site: unknown value 'mlp'; choose one of resid, mlp_out, attn_out" in err, err
    assert not (tmp_path / "bad").exists()

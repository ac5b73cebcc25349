"""The training config: every bad field gets one error naming it; TOML and flags agree."""

from __future__ import annotations

import pytest

from conftest import run_cli
from sae_dist.config import TrainConfig, build_config, load_toml, parse_devices
from sae_dist.defaults import default_lr
from sae_dist.errors import ConfigError
from sae_dist.train.lr import lr_at
from sae_dist.train.metrics import find_stragglers


@pytest.mark.parametrize("values, field, words", [
    ({"architecture": "gated"}, "architecture", "unknown value 'gated'"),
    ({"k": 100, "d_in": 8, "d_sae": 64}, "k", "more than d_sae"),
    ({"lr": 0.0}, "lr", "positive"),
    ({"lr": -1e-3}, "lr", "positive"),
    ({"batch_size": 0}, "batch_size", "positive"),
    ({"steps": -5}, "steps", "positive"),
    ({"steps": 10**15}, "steps", "1,000,000,000,000,000 is more than 1,000,000,000"),  # a typo, never a plan
    ({"lr": float("inf")}, "lr", "must be finite"),
    ({"batch_size": 1.5}, "batch_size", "whole number"),
    ({"source": "web"}, "source", "unknown value"),
    ({"source": "shards"}, "shards_path", "needs the directory"),
    ({"precision": "fp8"}, "precision", "unknown value"),
    ({"devices": "tpu:2"}, "devices", "unknown device kind"),
    ({"devices": "cpu:0"}, "devices", "positive whole number"),
    ({"lr_decay_fraction": 2.0}, "lr_decay_fraction", "between 0 and 1"),
    ({"decoder_lr_factor": 0}, "decoder_lr_factor", "must be positive, got 0"),
    ({"decoder_lr_factor": -2.0}, "decoder_lr_factor", "must be positive, got -2.0"),
    ({"decoder_lr_factor": float("nan")}, "decoder_lr_factor", "must be a number, got nan"),
    ({"resume": True}, "resume", "needs out_dir"),
    ({"stepz": 10}, "stepz", "did you mean 'steps'"),
    ({"auxk_k": 1000, "d_in": 8, "d_sae": 64}, "auxk_k", "more than d_sae"),
    ({"architecture": "matryoshka", "matryoshka_widths": "64,16", "d_in": 8, "d_sae": 64}, "matryoshka_widths",
     "each width must be larger than the one before"),
    ({"architecture": "matryoshka", "matryoshka_widths": "16,32", "d_in": 8, "d_sae": 64}, "matryoshka_widths",
     "the last width is the whole dictionary: 32 given, d_sae is 64"),
    ({"architecture": "matryoshka", "matryoshka_widths": "16;64"}, "matryoshka_widths", "give increasing whole"),
    ({"architecture": "matryoshka", "matryoshka_widths": "0,64"}, "matryoshka_widths", "from 1 up"),
    ({"matryoshka_widths": "16,64"}, "matryoshka_widths", "given, but the architecture is topk"),
    ({"matryoshka_selection": "batch"}, "matryoshka_selection", "given, but the architecture is topk"),
    ({"architecture": "matryoshka", "matryoshka_selection": "rows"}, "matryoshka_selection",
     "unknown value 'rows'; choose one of sample, batch"),
    ({"matryoshka_inner_weight": 0.5}, "matryoshka_inner_weight", "given, but the architecture is topk"),
    ({"architecture": "matryoshka", "matryoshka_inner_weight": -1.0}, "matryoshka_inner_weight",
     "must be 0 or more, got -1.0"),
    ({"architecture": "matryoshka", "matryoshka_inner_weight": float("nan")}, "matryoshka_inner_weight",
     "must be 0 or more"),
    ({"synthetic_child_prob": 1.5}, "synthetic_child_prob", "must be between 0 and 1, got 1.5"),
    ({"synthetic_child_prob": float("nan")}, "synthetic_child_prob", "must be between 0 and 1"),
    ({"synthetic_children": -1}, "synthetic_children", "non-negative"),
    ({"synthetic_children": 1.5}, "synthetic_children", "whole number"),
    ({"synthetic_children": 4, "synthetic_features": 3}, "synthetic_features", "cannot hold one parent with 4"),
    ({"synthetic_magnitude_sigma": -0.5}, "synthetic_magnitude_sigma", "non-negative"),
    ({"synthetic_correlation": 1.5}, "synthetic_correlation", "must be between 0 and 1, got 1.5"),
    ({"refit_fraction": 1.5}, "refit_fraction", "must be between 0 and 1, got 1.5"),
    ({"refit_fraction": float("nan")}, "refit_fraction", "must be between 0 and 1"),
    ({"architecture": "standard", "refit_fraction": 0.2}, "refit_fraction",
     "refits a decoder to TopK-family codes (topk, batchtopk, matryoshka); the architecture is standard"),
])
def test_bad_values_name_the_field(values, field, words):
    with pytest.raises(ConfigError) as e:
        build_config(values)
    assert e.value.field == field
    assert words in str(e.value)


def test_defaults_and_resolution():
    cfg = TrainConfig()
    assert cfg.architecture == "topk" and cfg.source == "synthetic"
    cfg = cfg.with_d_in(512)
    assert cfg.resolved_d_sae == 4096 and cfg.resolved_auxk_k == 256
    assert cfg.resolved_lr == float(f"{default_lr(4096, 4096, 32, 512):.3g}")  # the rule, 3 digits
    assert build_config({"architecture": "relu"}).architecture == "standard"


def test_matryoshka_widths_default_and_given():
    """Blank: d_sae/4, d_sae (one under 1 latent left out); given as a flag's text or a TOML list,
    checked against d_sae once d_in is known."""
    cfg = TrainConfig(architecture="matryoshka").with_d_in(512)
    assert cfg.resolved_matryoshka_widths == (1024, 4096)
    assert TrainConfig(architecture="matryoshka", d_in=2, d_sae=3, k=1).resolved_matryoshka_widths == (3,)
    given = build_config({"architecture": "matryoshka_batchtopk", "d_in": 8, "d_sae": 64,
                          "matryoshka_widths": [16, 32, 64]})  # SAELens' name, a TOML list
    assert given.architecture == "matryoshka" and given.resolved_matryoshka_widths == (16, 32, 64)
    assert given.matryoshka_selection == "batch" and given.batch_level  # SAELens' name says how it selects
    plain = TrainConfig(architecture="matryoshka")
    assert plain.matryoshka_selection is None and not plain.batch_level  # each sample's top k by default
    assert TrainConfig(architecture="batchtopk").batch_level and not TrainConfig().batch_level


def test_d_in_from_source_must_agree():
    with pytest.raises(ConfigError, match="d_in: is 64 but the source's activations have width 32"):
        TrainConfig(d_in=64).with_d_in(32)


def test_toml_flat_or_train_table(tmp_path):
    (tmp_path / "a.toml").write_text('architecture = "batchtopk"\nk = 16\nlr = 1e-3\n')
    (tmp_path / "b.toml").write_text('[train]\narchitecture = "batchtopk"\nk = 16\nlr = 1e-3\n')
    assert load_toml(tmp_path / "a.toml") == load_toml(tmp_path / "b.toml")
    cfg = build_config(load_toml(tmp_path / "a.toml"))
    assert (cfg.architecture, cfg.k, cfg.lr) == ("batchtopk", 16, 1e-3)
    (tmp_path / "bad.toml").write_text("k = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="k: must be a whole number"):
        build_config({"k": "many"})


def test_parse_devices():
    assert parse_devices("auto") == ("auto", None)
    assert parse_devices("cpu:4") == ("cpu", 4)
    assert parse_devices("gpu:2") == ("cuda", 2)
    assert parse_devices("cuda") == ("cuda", None)


def test_lr_schedule():
    assert lr_at(1, 1.0, 100, warmup_steps=10) == pytest.approx(0.1)
    assert lr_at(50, 1.0, 100, warmup_steps=10) == 1.0
    assert lr_at(100, 1.0, 100, decay_fraction=0.2) == pytest.approx(1 / 21)
    assert lr_at(80, 1.0, 100, decay_fraction=0.2) == 1.0
    assert all(lr_at(s, 1.0, 100, 5, 0.3) > 0 for s in range(1, 101))


def test_stragglers():
    assert find_stragglers([0.10, 0.10, 0.10, 0.30]) == [3]
    assert find_stragglers([0.10, 0.30]) == [1]
    assert find_stragglers([0.10, 0.12]) == []
    assert find_stragglers([0.0001, 0.0003]) == []  # microseconds of jitter are no straggler
    assert find_stragglers([0.5]) == []


def one_line_error(code: int, err: str, words: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert "Traceback" not in err


BAD_TRAIN_FLAGS = [
    (["--architecture", "gated"], "architecture: unknown value 'gated'"),
    (["--k", "5000", "--d-in", "16", "--d-sae", "64"], "k: k = 5000 is more than d_sae = 64"),
    (["--lr", "-1"], "lr: must be positive"),
    (["--batch-size", "0"], "batch_size: must be positive"),
    (["--source", "shards", "--shards-path", "/nonexistent/acts"], "/nonexistent/acts"),
    (["--config", "/nonexistent/run.toml"], "no such file"),
    (["--devices", "cuda:2"], "no CUDA GPU"),
    (["--grad-accum", "0"], "grad_accum: must be positive"),
    (["--ddp-compress", "int8"], "ddp_compress: unknown value 'int8'"),
    (["--ddp-bucket-mb", "-2"], "ddp_bucket_mb: must be positive"),
    (["--context-length", "0"], "context_length: must be positive"),
    (["--model-layer", "-1"], "model_layer: must be non-negative"),
    (["--source", "model", "--model-path", "/m"], "text_path: source = model needs the model"),
    (["--text-path", "notes.txt"], "text_path: given, but source is synthetic"),
    (["--architecture", "matryoshka", "--d-in", "16", "--d-sae", "64", "--matryoshka-widths", "8,32"],
     "matryoshka_widths: the last width is the whole dictionary: 32 given, d_sae is 64"),
    (["--matryoshka-widths", "8,64"], "matryoshka_widths: given, but the architecture is topk"),
]


@pytest.mark.parametrize("args, words", BAD_TRAIN_FLAGS)
def test_cli_bad_input_is_one_line(args, words, cli):
    """`train`'s refusals through sae_dist.cli.main in this process: nothing starts."""
    code, out, err = cli("train", "--no-db", "--steps", "1", *args)
    one_line_error(code, err, words)


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [BAD_TRAIN_FLAGS[0], BAD_TRAIN_FLAGS[-1]])
def test_cli_bad_input_is_one_line_from_a_real_process(args, words):
    result = run_cli("train", "--no-db", "--steps", "1", *args, timeout=60)
    one_line_error(result.returncode, result.stderr, words)


def test_estimate_memory_cli():
    result = run_cli("estimate-memory", "--d-in", "512", "--d-sae", "4096", "--batch-size", "4096",
                     "--devices", "cpu:1", timeout=60)
    assert result.returncode == 0, result.stderr
    # CPU ranks: the CPU runtime (216 MiB measured), never a CUDA context's 750 MiB
    assert "runtime 216.0 MiB" in result.stdout and "750.0 MiB" not in result.stdout
    from sae_dist.memory import estimate_memory

    assert result.stdout.strip() == estimate_memory(512, 4096, 4096, device_type="cpu").describe()


def test_one_rule_names_a_run_without_a_name():
    """The trainer and the Train page (which names a job and its run alike) ask one function."""
    from datetime import datetime

    from sae_dist.paths import default_run_name

    at = datetime(2026, 11, 27, 7, 18, 5)
    cfg = TrainConfig(d_in=64, expansion_factor=4)
    assert default_run_name(cfg, now=at) == "topk-256-20261127-071805"
    assert default_run_name(cfg, saes=8, now=at) == "sweep8-20261127-071805"

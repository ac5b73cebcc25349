"""The selection bias for rare latents: its rule on plain numbers, the forward it steers, its
settings' errors, and runs that use it (one rank against two, a resume, a sweep's SAEs)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import CONSTANT_INNER_WEIGHT, LENGTH_FREE_SCHEDULE, main_here, run_cli
from sae_dist.config import TrainConfig, build_config
from sae_dist.defaults import describe_resolved
from sae_dist.errors import ConfigError
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.checkpoint import STATE, WEIGHTS, latest_checkpoint
from sae_dist.train.rare_bias import RATE_EMA_PER_STEP, RareBiasRule, moved, rule_for, rule_of

RULE = RareBiasRule(floor_rate=0.01, step=0.1, stop_step=100)


# ---- the rule, on plain numbers ----
def test_a_rare_latent_s_bias_rises_and_a_common_one_s_falls_to_zero_at_least():
    bias, rate = torch.tensor([0.0, 0.5, 0.02]), torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    fired = torch.tensor([0.0, 500.0, 500.0], dtype=torch.float64)  # of 1,000 rows
    # The first never fired: its average falls under the floor only after enough windows.
    for _ in range(30):
        bias, rate = moved(bias, rate, fired, 1000, 2.0, 10, RULE)
    assert rate[0] < RULE.floor_rate and bias[0] > 0
    assert rate[1] == pytest.approx(0.5, abs=0.03) and bias[1] == 0 and bias[2] == 0  # lowered, never below 0
    before = bias[0].item()
    bias, rate = moved(bias, rate, fired, 1000, 2.0, 10, RULE)
    assert bias[0].item() == pytest.approx(before + 10 * RULE.step * 2.0)  # steps x step x mean activation


def test_a_window_of_steps_weighs_its_rate_as_that_many_single_steps():
    rate0, fired = torch.tensor([0.2], dtype=torch.float64), torch.tensor([30.0], dtype=torch.float64)
    _, windowed = moved(torch.zeros(1), rate0, fired, 100, 1.0, 10, RULE)
    single = rate0.clone()
    for _ in range(10):
        single = single.lerp(torch.tensor([0.3], dtype=torch.float64), RATE_EMA_PER_STEP)
    assert windowed.item() == pytest.approx(single.item(), rel=1e-12)


def test_the_rule_of_a_run_s_settings():
    assert rule_of(0.0, 0.01, 0.7, 32, 4096, 1000) is None  # floor 0: off
    assert rule_of(0.1, 0.01, 0.7, 32, 4096, 1000) == RareBiasRule(0.1 * 32 / 4096, 0.01, 700)
    matryoshka = TrainConfig(architecture="matryoshka", k=16, steps=50).with_d_in(64)
    assert rule_for(matryoshka) == RareBiasRule(0.4 * 16 / 512, 0.01, 35)  # on by default
    assert rule_for(TrainConfig().with_d_in(64)) is None  # TopK: off unless asked for
    assert rule_for(TrainConfig(architecture="matryoshka", matryoshka_selection="batch").with_d_in(64)) is None
    assert rule_for(TrainConfig(architecture="standard", rare_bias_floor=0).with_d_in(64)) is None
    asked = rule_for(TrainConfig(rare_bias_floor=0.2, rare_bias_step=0.05, rare_bias_until=0.5, k=8, steps=10)
                     .with_d_in(8))
    assert asked == RareBiasRule(0.2 * 8 / 64, 0.05, 5)


def test_the_resolved_settings_say_whether_the_bias_is_on():
    line = describe_resolved(TrainConfig(architecture="matryoshka"),
                             TrainConfig(architecture="matryoshka").with_d_in(64).resolved(1))
    assert "rare-latent bias under 0.4 of the average rate for the first 70% of the steps (default)" in line
    assert "no rare-latent bias (default)" in describe_resolved(TrainConfig(), TrainConfig().with_d_in(64).resolved(1))


# ---- the forward it steers ----
@pytest.mark.parametrize("architecture", ["topk", "batchtopk", "matryoshka"])
def test_the_bias_chooses_which_latents_fire_but_not_their_values(architecture):
    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 64, architecture, k=4, seed=1, auxk_coefficient=1 / 32)
    x = torch.randn(32, 16)
    plain = sae(x)
    assert torch.equal(sae(x, selection_bias=torch.zeros(64)).x_hat, plain.x_hat)  # no bias, no change
    never = int(plain.fired.argmin())
    assert plain.fired[never] == 0
    bias = torch.zeros(64)
    bias[never] = 50.0  # chosen in every row (every row's top k, or the batch's k x rows)
    dead = torch.zeros(64, dtype=torch.bool)
    dead[never] = True
    out = sae(x, dead_mask=dead, selection_bias=bias)
    pre = sae.pre_acts(x)[:, never].detach()
    chosen = out.codes.pattern.col == never
    assert int(chosen.sum()) == 32
    rows = out.codes.pattern.row_of_entry()[chosen]
    # Its own value, not 50 more (to float32's rounding of the biased sum).
    assert torch.allclose(out.codes.acts[chosen].detach(), pre[rows].clamp_min(0), atol=1e-5)
    assert out.fired[never] == int((pre > 0).sum())  # fires where its value is positive only
    assert torch.isfinite(out.loss) and float(out.auxk_loss.detach()) < 50  # AuxK's values are unbiased too
    out.loss.backward()
    assert sae.b_enc.grad is not None and torch.isfinite(sae.b_enc.grad).all()


# ---- its settings ----
def test_the_flags_help_gives_the_defaults_a_run_resolves():
    """The help is what a user reads before a run: it once said 0.2 after the floor became 0.4."""
    import dataclasses

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
    floor, step, until = TrainConfig(architecture="matryoshka", d_in=16).resolved_rare_bias
    assert f"default {floor} for matryoshka" in helps["rare_bias_floor"]
    assert helps["rare_bias_step"].endswith(f"default {step}")
    assert helps["rare_bias_until"].endswith(f"default {until}")


@pytest.mark.parametrize("values, field, words", [
    ({"rare_bias_floor": 1.5}, "rare_bias_floor", "must be a fraction from 0 up to 1, got 1.5"),
    ({"rare_bias_floor": -0.1}, "rare_bias_floor", "must be a fraction from 0 up to 1"),
    ({"rare_bias_floor": float("nan")}, "rare_bias_floor", "must be a fraction from 0 up to 1, got nan"),
    ({"rare_bias_step": 0}, "rare_bias_step", "must be a fraction above 0 up to 1, got 0"),
    ({"rare_bias_until": 0}, "rare_bias_until", "must be a fraction above 0 up to 1"),
    ({"rare_bias_until": 2}, "rare_bias_until", "must be a fraction above 0 up to 1, got 2"),
    ({"architecture": "standard", "rare_bias_floor": 0.1}, "rare_bias_floor",
     "biases which latents a TopK-family SAE chooses (topk, batchtopk, matryoshka); the architecture is standard"),
    ({"architecture": "jumprelu", "rare_bias_until": 0.5}, "rare_bias_until", "the architecture is jumprelu"),
])
def test_bad_settings_name_the_field(values, field, words):
    with pytest.raises(ConfigError) as e:
        build_config(values)
    assert e.value.field == field and words in str(e.value)


def test_a_bad_setting_is_one_line_and_exit_2_before_anything_starts(tmp_path):
    ran = main_here("train", "--architecture", "jumprelu", "--rare-bias-floor", "0.1", "--no-db",
                    "--out-dir", str(tmp_path / "run"))
    assert ran.returncode == 2
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rare_bias_floor" in lines[0] and "jumprelu" in lines[0], ran.stderr
    assert not (tmp_path / "run").exists()
    assert build_config({"architecture": "standard", "rare_bias_floor": 0}).rare_bias_floor == 0  # off: fine


# ---- runs ----
SMALL = ["--architecture", "matryoshka", "--d-in", "32", "--d-sae", "256", "--k", "4", "--synthetic-features", "128",
         "--seed", "5", "--log-every", "5", *LENGTH_FREE_SCHEDULE, "--refit-fraction", "0", "--eval-rows", "0",
         # Under the average rate is rare (the rates' averages start at it, so a latent that fires
         # less is rare at the first check), the bias moves fast and stays to the end: it shapes the run.
         "--rare-bias-step", "0.1", "--rare-bias-until", "1", *CONSTANT_INNER_WEIGHT]
FLOOR = ["--rare-bias-floor", "1"]


def _weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / WEIGHTS))


def _rel_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def _ok(ran):
    assert ran.returncode == 0, f"exit {ran.returncode}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    return ran


@pytest.mark.slow
def test_two_ranks_resumed_mid_bias_end_where_one_rank_straight_does(tmp_path):
    """The bias moves from all-reduced firings (the same on every rank, whatever the split) and
    is checkpointed with the firings parked between checks: 2 ranks stopped at step 15 (the bias
    moved at 10, half a window parked) and resumed to 30 equal 1 rank straight. A run without the
    bias ends elsewhere: it mattered."""
    one = [*SMALL, *FLOOR, "--devices", "cpu:1", "--batch-size", "128", "--checkpoint-every", "0", "--no-db"]
    _ok(main_here("train", *one, "--steps", "30", "--out-dir", str(tmp_path / "straight")))
    _ok(main_here("train", *one, "--steps", "30", "--rare-bias-floor", "0", "--out-dir", str(tmp_path / "none")))
    two = [*SMALL, *FLOOR, "--devices", "cpu:2", "--batch-size", "64", "--checkpoint-every", "15", "--no-db"]
    _ok(run_cli("train", *two, "--steps", "15", "--out-dir", str(tmp_path / "split")))
    saved = torch.load(latest_checkpoint(tmp_path / "split") / STATE, weights_only=False)
    assert saved["selection_bias"].max() > 0 and saved["parked_fired"].shape == (256 + 2,)
    assert "resumed from" in _ok(run_cli("train", *two, "--steps", "30", "--out-dir", str(tmp_path / "split"),
                                         "--resume")).stdout
    straight = _weights(tmp_path / "straight")
    assert _rel_diff(_weights(tmp_path / "split"), straight) < 1e-5
    assert _rel_diff(_weights(tmp_path / "none"), straight) > 1e-3


@pytest.mark.slow
def test_a_sweep_s_saes_each_keep_their_own_bias(tmp_path):
    """Sweeping the floor in one job: each SAE equals it trained alone (the bias is each SAE's)."""
    one = [*SMALL, "--devices", "cpu:1", "--batch-size", "128", "--steps", "20", "--checkpoint-every", "0", "--no-db"]
    _ok(main_here("train", *one, "--sweep", "rare_bias_floor=0,1", "--out-dir", str(tmp_path / "sweep")))
    for floor in ("0", "1"):
        _ok(main_here("train", *one, "--rare-bias-floor", floor, "--out-dir", str(tmp_path / floor)))
        name = next(p.name for p in (tmp_path / "sweep" / "saes").iterdir() if p.name.endswith(f"rare{floor}"))
        assert _rel_diff(_weights(tmp_path / "sweep" / "saes" / name), _weights(tmp_path / floor)) < 1e-6, name

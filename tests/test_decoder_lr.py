"""The decoder's learning rate apart from the rest (--decoder-lr-factor): the optimizer's groups on
plain parameters, checkpoints saved with the other layout, a real run that resumes exactly, a
sweep's names and the bad values."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL_MATRYOSHKA, main_here, same_weights
from conftest import final_checkpoint_weights as final_weights
from sae_dist.contract.sweep import point_name
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.step import load_optimizer, make_optimizer, set_lr


def small_sae() -> SparseAutoencoder:
    return SparseAutoencoder(8, 32, "topk", 4, seed=1, device="cpu")


def stepped(sae: SparseAutoencoder, factor: float) -> torch.optim.Adam:
    """An optimizer with Adam's moments after two steps on a fixed loss."""
    opt = make_optimizer(sae, 1e-3, factor)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        sae(x).loss.backward()
        opt.step()
    return opt


def test_a_factor_puts_the_decoder_in_a_group_of_its_own_at_that_multiple():
    sae = small_sae()
    assert len(make_optimizer(sae, 1e-3).param_groups) == 1  # no factor: one group, as before the factor
    opt = make_optimizer(sae, 1e-3, 3.0)
    rest, decoder = opt.param_groups
    assert decoder["params"] == [sae.W_dec] and all(p is not sae.W_dec for p in rest["params"])
    assert len(rest["params"]) + 1 == len(list(sae.parameters()))
    assert decoder["lr"] == pytest.approx(3e-3) and rest["lr"] == 1e-3
    set_lr(opt, 5e-4, 3.0)  # each step's lr, from the schedule
    assert decoder["lr"] == pytest.approx(1.5e-3) and rest["lr"] == 5e-4


@pytest.mark.parametrize("saved_with, resumed_with", [(1.0, 3.0), (3.0, 1.0), (2.0, 3.0)])
def test_a_checkpoint_of_the_other_layout_loads_with_each_parameters_moments(saved_with, resumed_with):
    """A run saved with one group (no factor, or from before it) resumes with a factor, and back:
    Adam's moments stay with their parameters."""
    sae = small_sae()
    before = stepped(sae, saved_with)
    opt = make_optimizer(sae, 1e-3, resumed_with)
    load_optimizer(opt, sae, before.state_dict())
    assert len(opt.param_groups) == (1 if resumed_with == 1 else 2)
    for p in sae.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], before.state[p][key])
    set_lr(opt, 1e-3, resumed_with)
    assert opt.param_groups[-1]["lr"] == pytest.approx(1e-3 * resumed_with)  # the factor of the resumed run


def test_matryoshka_choosing_each_rows_top_k_moves_its_decoder_at_3x_by_default():
    from sae_dist.config import TrainConfig

    def factor(**settings):
        return TrainConfig(d_in=64, **settings).resolved(1).decoder_lr_factor

    assert factor(architecture="matryoshka") == 3.0
    assert factor(architecture="matryoshka", matryoshka_selection="batch") == 1.0  # as measured
    assert factor() == factor(architecture="batchtopk") == factor(architecture="jumprelu") == 1.0
    assert factor(architecture="matryoshka", decoder_lr_factor=1.0) == 1.0  # given: kept
    assert factor(decoder_lr_factor=2.5) == 2.5


def test_a_sweep_names_its_points_by_the_factor():
    assert point_name({"decoder_lr_factor": 3.0}) == "declr3"
    assert point_name({"k": 16, "decoder_lr_factor": 0.5}) == "k16-declr0.5"


def run(tmp_path, name: str, *args: str) -> str:
    done = main_here("train", *SMALL_MATRYOSHKA, *args, "--out-dir", str(tmp_path / name))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # three short trainings in this process
def test_a_run_with_a_factor_trains_otherwise_and_resumes_exactly(tmp_path):
    run(tmp_path, "straight", "--steps", "12", "--decoder-lr-factor", "3")
    run(tmp_path, "plain", "--steps", "12", "--decoder-lr-factor", "1")
    out = run(tmp_path, "split", "--steps", "6", "--decoder-lr-factor", "3")
    assert "decoder at 3x the lr" in out  # the resolved settings say so
    out = run(tmp_path, "split", "--steps", "12", "--decoder-lr-factor", "3", "--resume")
    assert "resumed from" in out
    straight, split, plain = (final_weights(tmp_path / n) for n in ("straight", "split", "plain"))
    assert same_weights(split, straight)
    assert (straight["W_dec"] - plain["W_dec"]).norm() > 1e-3 * plain["W_dec"].norm()  # the factor took effect


def test_a_bad_factor_is_one_line_and_exit_2_before_anything_starts(tmp_path):
    done = main_here("train", "--decoder-lr-factor", "-1", "--no-db", "--out-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "decoder_lr_factor" in lines[0] and "positive" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()

"""Matryoshka's inner offset (--matryoshka-inner-offset): the inner prefixes decode through W_dec
plus a learnt offset of their rows, the whole dictionary through W_dec alone; the offset is
trained and checkpointed, never exported. Its default, a real run that resumes exactly, old
checkpoints without it, a sweep's names, and the bad inputs."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL_MATRYOSHKA, main_here
from conftest import final_checkpoint_weights as final_weights
from conftest import same_weights as same
from sae_dist.config import ConfigError, TrainConfig
from sae_dist.contract.sweep import SweepError, parse_sweep_flags, point_name
from sae_dist.defaults import describe_resolved
from sae_dist.memory import estimate_for_config
from sae_dist.models.sae import SparseAutoencoder


def matryoshka(offset: bool = True) -> SparseAutoencoder:
    return SparseAutoencoder(8, 32, "matryoshka", 4, matryoshka_widths=(4, 16, 32), matryoshka_inner_offset=offset,
                             seed=1, device="cpu")


def rows(n: int = 64) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(0))


def test_the_offset_covers_the_inner_prefixes_rows_and_is_left_out_of_the_export():
    sae = matryoshka()
    assert sae.inner_offset.shape == (16, 8) and sae.inner_offset.abs().sum() == 0  # rows of the widest inner prefix
    assert "W_inner_offset" in sae.state_dict()  # checkpointed
    assert set(sae.inference_state_dict()) == {"W_enc", "b_enc", "W_dec", "b_dec"}  # never exported
    assert matryoshka(offset=False).inner_offset is None
    assert SparseAutoencoder(8, 32, "topk", 4, matryoshka_inner_offset=True, device="cpu").inner_offset is None


def dense_prefix_errors(sae: SparseAutoencoder, x: torch.Tensor, decoder: torch.Tensor) -> tuple[float, float]:
    """The whole dictionary's and the inner prefixes' squared errors, written out densely."""
    acts = sae.encode(x).detach()
    whole = (acts @ sae.W_dec.detach() + sae.b_dec.detach() - x).pow(2).sum(-1).mean()
    inner = sum(((acts * (torch.arange(sae.d_sae) < w)) @ decoder + sae.b_dec.detach() - x).pow(2).sum(-1).mean()
                for w in sae.matryoshka_widths[:-1])
    return float(whole), float(inner)


def test_the_inner_prefixes_decode_through_the_offset_and_the_whole_dictionary_without_it():
    sae = matryoshka()
    with torch.no_grad():
        sae.inner_offset.copy_(torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
    x = rows()
    out = sae(x)
    decoder = sae.W_dec.detach().clone()
    decoder[:16] += sae.inner_offset.detach()
    whole, inner = dense_prefix_errors(sae, x, decoder)
    assert out.mse.item() == pytest.approx(whole, rel=1e-5)
    assert out.prefix_mse.item() == pytest.approx(inner, rel=1e-5)
    assert out.prefix_mse.item() != pytest.approx(dense_prefix_errors(sae, x, sae.W_dec.detach())[1], rel=1e-3)
    out.loss.backward()
    # the inner losses train the offset and, through the same sum, the decoder's rows
    assert sae.inner_offset.grad.abs().sum() > 0 and sae.W_dec.grad[:16].abs().sum() > 0


@pytest.mark.parametrize("offset,selection", [(True, "sample"), (False, "sample"), (False, "batch")])
def test_every_gradient_of_the_prefixes_loss_is_the_dense_autograd_ones(offset, selection):
    """The prefixes decode only their own entries (and the offset's rows, not a copy of W_dec):
    the loss and every parameter's gradient are what plain autograd through dense matrices gives."""
    sae = SparseAutoencoder(8, 32, "matryoshka", 4, matryoshka_widths=(4, 16, 32), matryoshka_inner_offset=offset,
                            matryoshka_selection=selection, matryoshka_inner_weight=1.5, seed=1, device="cpu")
    if offset:
        with torch.no_grad():
            sae.inner_offset.copy_(0.3 * torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))
    x = rows()
    sae(x).loss.backward()
    got = {name: p.grad.clone() for name, p in sae.named_parameters()}
    sae.zero_grad()

    pre = sae.pre_acts(x)
    if selection == "batch":
        vals, idx = pre.reshape(-1).topk(4 * x.shape[0])
        acts = torch.zeros_like(pre).reshape(-1).scatter(0, idx, vals.relu()).view_as(pre)
    else:
        vals, idx = pre.topk(4, dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    decoder = torch.cat([sae.W_dec[:16] + sae.inner_offset, sae.W_dec[16:]]) if offset else sae.W_dec
    loss = (acts @ sae.W_dec + sae.b_dec - x).pow(2).sum(-1).mean()
    for width in (4, 16):
        loss = loss + 1.5 * ((acts * (torch.arange(32) < width)) @ decoder + sae.b_dec - x).pow(2).sum(-1).mean()
    loss.backward()
    for name, p in sae.named_parameters():
        if name != "topk_threshold":
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_on_by_default_for_matryoshka_choosing_each_rows_top_k_and_said_so():
    def offset(**settings):
        return TrainConfig(d_in=64, **settings).resolved(1).matryoshka_inner_offset

    assert offset(architecture="matryoshka") is True
    assert offset(architecture="matryoshka", matryoshka_selection="batch") is False  # not measured there
    assert offset(architecture="matryoshka", matryoshka_inner_offset=False) is False
    assert offset() is None and offset(architecture="batchtopk") is None  # no inner prefixes
    given = TrainConfig(d_in=64, architecture="matryoshka")
    assert "inner prefixes through their own offset (default)" in describe_resolved(given, given.resolved(1))
    off = TrainConfig(d_in=64, architecture="matryoshka", matryoshka_inner_offset=False)
    assert "offset" not in describe_resolved(off, off.resolved(1))


def test_the_memory_estimate_counts_the_offset():
    on = estimate_for_config(TrainConfig(d_in=64, d_sae=1024, architecture="matryoshka", devices="cpu:1"), 1)
    off = estimate_for_config(TrainConfig(d_in=64, d_sae=1024, architecture="matryoshka", devices="cpu:1",
                                          matryoshka_inner_offset=False), 1)
    assert on.params - off.params == 256 * 64 * 4  # d_sae/4 rows of d_in, fp32
    assert on.activations - off.activations == 2 * 256 * 64 * 4  # the inner rows' decoder and its gradient


def test_a_sweep_turns_it_on_and_off_by_name():
    assert parse_sweep_flags(["matryoshka_inner_offset=on,off"]) == {"matryoshka_inner_offset": [True, False]}
    assert point_name({"matryoshka_inner_offset": True}) == "ioff1"
    assert point_name({"k": 16, "matryoshka_inner_offset": False}) == "k16-ioff0"
    with pytest.raises(SweepError, match="matryoshka_inner_offset.*'maybe' is not on or off"):
        parse_sweep_flags(["matryoshka_inner_offset=on,maybe"])


def test_given_for_an_architecture_without_prefixes_is_a_config_error():
    with pytest.raises(ConfigError, match="matryoshka_inner_offset.*add --architecture matryoshka"):
        TrainConfig(architecture="topk", matryoshka_inner_offset=True)


def test_given_for_topk_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = main_here("train", "--matryoshka-inner-offset", "--no-db", "--out-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "matryoshka_inner_offset" in lines[0], done.stderr
    assert not (tmp_path / "run").exists()


def run(tmp_path, name: str, *args: str):
    done = main_here("train", *SMALL_MATRYOSHKA, *args, "--out-dir", str(tmp_path / name))
    return done


def trained(tmp_path, name: str, *args: str) -> str:
    done = run(tmp_path, name, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # four short trainings in this process
def test_a_run_with_the_offset_trains_otherwise_and_resumes_exactly(tmp_path):
    out = trained(tmp_path, "straight", "--steps", "12")
    assert "inner prefixes through their own offset" in out
    trained(tmp_path, "without", "--steps", "12", "--no-matryoshka-inner-offset")
    trained(tmp_path, "split", "--steps", "6")
    assert "resumed from" in trained(tmp_path, "split", "--steps", "12", "--resume")
    straight, split, without = (final_weights(tmp_path / n) for n in ("straight", "split", "without"))
    assert "W_inner_offset" in straight and "W_inner_offset" not in without
    assert same(split, straight)
    assert straight["W_inner_offset"].abs().sum() > 0  # it learnt something
    assert (straight["W_dec"] - without["W_dec"]).norm() > 1e-3 * without["W_dec"].norm()  # and it took effect


@pytest.mark.slow  # three short trainings in this process
def test_a_checkpoint_from_before_the_offset_goes_on_without_it(tmp_path):
    """A run begun without the offset (as every run before it) resumes by default, and trains on
    exactly as it began; a run trained with it cannot resume without it."""
    trained(tmp_path, "without", "--steps", "12", "--no-matryoshka-inner-offset")
    trained(tmp_path, "old", "--steps", "6", "--no-matryoshka-inner-offset")
    out = trained(tmp_path, "old", "--steps", "12", "--resume")  # the default is on now
    assert "written without the inner offset; the run goes on without it" in out
    assert same(final_weights(tmp_path / "old"), final_weights(tmp_path / "without"))

    trained(tmp_path, "new", "--steps", "6")
    before = final_weights(tmp_path / "new")
    done = run(tmp_path, "new", "--steps", "12", "--resume", "--no-matryoshka-inner-offset")
    assert done.returncode != 0
    assert "trained with Matryoshka's inner offset" in done.stderr and "--matryoshka-inner-offset" in done.stderr
    assert same(final_weights(tmp_path / "new"), before)  # the checkpoint is as it was

"""The decoder refit: its sums and solve on plain data, its window, and in a run (one and two
ranks, a resume inside its window, the command line's errors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import LENGTH_FREE_SCHEDULE, main_here, run_cli
from sae_dist.config import TrainConfig
from sae_dist.memory import estimate_for_config, refit_bytes
from sae_dist.models.refit import DecoderRefit, refit_decoder
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.models.sparse_ops import Pattern
from sae_dist.train.checkpoint import STATE, latest_checkpoint
from sae_dist.train.refit import window_start

SMALL = ["--d-in", "32", "--d-sae", "128", "--k", "8", "--synthetic-features", "96", "--log-every", "2",
         "--eval-rows", "0", "--architecture", "matryoshka", "--seed", "3"]


def sparse_codes(rows: int, d_sae: int, k: int, seed: int) -> tuple[Pattern, torch.Tensor, torch.Tensor]:
    """k distinct latents a row with positive values: (pattern, values in its order, the dense Z)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(rows, d_sae, generator=gen).topk(k, dim=1).indices
    vals = torch.rand(rows, k, generator=gen) + 0.1
    dense = torch.zeros(rows, d_sae).scatter_(1, idx, vals)
    return Pattern.per_row(idx, d_sae), vals.reshape(-1), dense


def summed(pattern: Pattern, vals: torch.Tensor, y: torch.Tensor) -> DecoderRefit:
    """One micro-batch's sums, the scales set from it."""
    refit = DecoderRefit(pattern.n_latents, y.shape[1], "cpu")
    refit.set_scales(vals, y)
    refit.add(pattern, vals, y)
    return refit


def assert_sums_are(refit: DecoderRefit, z: torch.Tensor, y: torch.Tensor, atol: float) -> None:
    """(Z^T Z, Z^T Y) as the solve reads them are the dense products."""
    gram, cross = refit.normal_equations()
    assert torch.allclose(gram, (z.T @ z).double(), atol=atol)
    assert torch.allclose(cross, (z.T @ y).double(), atol=atol)


def test_the_sums_are_z_transpose_z_and_z_transpose_y_whatever_the_split():
    pattern, vals, z = sparse_codes(200, 40, 5, seed=0)
    y = torch.randn(200, 6, generator=torch.Generator().manual_seed(1))
    whole = summed(pattern, vals, y)
    assert_sums_are(whole, z, y, atol=1e-5)
    # The same rows in two halves, the later first: Z^T Z the same integers; Z^T Y, summed a
    # micro-batch at a time before it is rounded to the grid, within a unit of it a micro-batch.
    halves = DecoderRefit(40, 6, "cpu")
    halves.scales = whole.scales
    for part in (slice(100, 200), slice(0, 100)):
        p, v, _ = sparse_codes(200, 40, 5, seed=0)
        sub = Pattern.per_row(p.col.view(200, 5)[part], 40)
        halves.add(sub, v.view(200, 5)[part].reshape(-1), y[part])
    assert torch.equal(halves.gram, whole.gram) and int((halves.cross - whole.cross).abs().max()) <= 2


def test_rows_of_unequal_counts_pair_only_their_own_latents():
    """BatchTopK's rows fire different numbers of latents: a row's pairs are its own."""
    crow = torch.tensor([0, 1, 4, 4, 6])  # 1, 3, 0 and 2 latents
    col = torch.tensor([2, 0, 1, 3, 3, 4])
    vals = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0, 0.25])
    pattern = Pattern(crow, col, 5)
    z = pattern.csr(vals).to_dense()
    y = torch.arange(8.0).view(4, 2)
    assert_sums_are(summed(pattern, vals, y), z, y, atol=1e-6)


def test_the_solve_finds_the_decoder_that_wrote_the_rows_and_keeps_unfired_rows():
    _, _, z = sparse_codes(500, 30, 4, seed=2)
    z[:, 7] = 0  # latent 7 never fires
    truth = torch.randn(30, 8, generator=torch.Generator().manual_seed(3))
    y = z @ truth
    old = torch.randn(30, 8, generator=torch.Generator().manual_seed(4))
    new = refit_decoder((z.T @ z).double(), (z.T @ y).double(), old, ridge=1e-9)
    fired = torch.arange(30) != 7
    assert torch.allclose(new[fired], truth[fired], atol=1e-4)
    assert torch.allclose(new[7], old[7])
    assert new.dtype == old.dtype
    nothing = torch.zeros(30, 30, dtype=torch.float64), torch.zeros(30, 8, dtype=torch.float64)
    assert torch.equal(refit_decoder(*nothing, old), old)  # no firing in the window: the old decoder


def test_each_latents_firings_are_counted():
    pattern, vals, z = sparse_codes(300, 40, 5, seed=5)
    vals = vals.clone()
    vals[:7] = 0  # a value of 0 (BatchTopK's padding, a ReLU at 0) is no firing
    z = pattern.csr(vals).to_dense()
    refit = summed(pattern, vals, torch.randn(300, 6))
    assert torch.equal(refit.firings, (z != 0).sum(0))


def test_a_latent_that_fired_a_few_times_stays_near_its_trained_row():
    """Its least-squares row would fit its few rows' noise; its trained row counts as
    `pseudo_firings` more firings. A latent that fired often is solved as before."""
    _, _, z = sparse_codes(2000, 30, 4, seed=6)
    z[:, 7] = 0
    z[:3, 7] = 1.0  # latent 7 fires in the first 3 rows only
    gen = torch.Generator().manual_seed(7)
    truth = torch.randn(30, 8, generator=gen)
    y = z @ truth + 0.3 * torch.randn(2000, 8, generator=gen)
    old = truth + 0.05 * torch.randn(30, 8, generator=gen)
    firings = (z != 0).sum(0)
    plain = refit_decoder((z.T @ z).double(), (z.T @ y).double(), old, ridge=1e-9)
    held = refit_decoder((z.T @ z).double(), (z.T @ y).double(), old, ridge=1e-9, firings=firings,
                         pseudo_firings=32)
    assert int(firings[7]) == 3 and int(firings[torch.arange(30) != 7].min()) > 200
    assert (held[7] - old[7]).norm() < 0.25 * (plain[7] - old[7]).norm()
    often = firings > 200
    assert int(often.sum()) >= 25 and torch.allclose(held[often], plain[often], atol=0.05)


def test_a_short_runs_refit_does_not_fit_its_few_rows_noise(tmp_path):
    """A 40-step run: its window's latents fire a few times each. With one ridge for every latent
    the default refit took held-out FVU from 0.41 to 6.5; it must not do worse than no refit."""
    fvu = {}
    for fraction in ("0", "0.2"):
        out = tmp_path / fraction
        ran = main_here("train", "--no-db", "--devices", "cpu:1", "--architecture", "matryoshka", "--d-in", "32",
                        "--synthetic-features", "128", "--d-sae", "512", "--k", "8", "--batch-size", "64",
                        "--steps", "40", "--refit-fraction", fraction, "--eval-rows", "4096",
                        "--checkpoint-every", "0", "--out-dir", str(out))
        assert ran.returncode == 0, ran.stderr
        fvu[fraction] = json.loads((out / "evaluation.json").read_text())["fvu"]
    assert fvu["0.2"] <= fvu["0"], fvu


def test_sums_saved_before_the_firings_were_counted_still_solve():
    pattern, vals, _ = sparse_codes(100, 20, 3, seed=8)
    y = torch.randn(100, 4, generator=torch.Generator().manual_seed(9))
    refit = summed(pattern, vals, y)
    old = torch.randn(20, 4)
    state = refit.state_dict()
    assert torch.equal(state["firings"], refit.firings)
    del state["firings"]  # a checkpoint of the ninth and tenth sessions' trainer
    loaded = DecoderRefit(20, 4, "cpu")
    loaded.load_state_dict(state)
    assert loaded.firings is None
    assert torch.allclose(loaded.solve(old), refit_decoder(*refit.normal_equations(), old))


def test_the_refit_decoder_reconstructs_the_rows_it_was_fit_on_better():
    """Least squares given the codes: on the window's own rows the refit cannot do worse."""
    torch.manual_seed(0)
    sae = SparseAutoencoder(16, 64, "matryoshka", k=4, matryoshka_widths=(16, 64), seed=0)
    x = torch.randn(2048, 16) @ torch.randn(16, 16)
    refit = DecoderRefit(64, 16, "cpu")
    for chunk in x.split(256):
        out = sae(chunk)
        if refit.scales is None:
            refit.set_scales(out.codes.acts, out.goal)
        refit.add(out.codes.pattern, out.codes.acts, out.goal)
    before = float(sae(x).mse.detach())
    with torch.no_grad():
        sae.W_dec.copy_(refit.solve(sae.W_dec))
    after = float(sae(x).mse.detach())
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("steps, fraction, start", [
    (100, 0.2, 80), (100, 0.0, 100), (10, 0.01, 9), (10, 1.0, 0), (7, 0.5, 3)])
def test_the_window_is_the_last_fraction_of_the_steps_and_at_least_one(steps, fraction, start):
    assert window_start(steps, fraction) == start


def test_the_estimate_counts_the_refit():
    base = TrainConfig(d_in=32, d_sae=128, architecture="matryoshka", refit_fraction=0)
    refit = TrainConfig(d_in=32, d_sae=128, architecture="matryoshka")  # Matryoshka's default refits
    a, b = estimate_for_config(base, 1, "cpu"), estimate_for_config(refit, 1, "cpu")
    assert a.refit == 0 and "refit" not in a.describe()
    assert b.total - a.total == refit_bytes(128, 32, base.batch_size, base.k) > 0 and "refit" in b.describe()


def decoder(run_dir) -> torch.Tensor:
    return load_file(str(latest_checkpoint(run_dir) / "sae.safetensors"))["W_dec"]


def test_a_stop_inside_the_window_on_two_ranks_refits_as_a_straight_run(tmp_path):
    """2 ranks stopped by a SIGTERM after step 5 of 12 (checkpoint at the report of step 6, inside
    the window from step 4: the sums are in it), then resumed: the decoder equals an uninterrupted
    run's on 1 rank, and differs from the decoder trained without the refit."""
    args = [*SMALL, "--checkpoint-every", "0", *LENGTH_FREE_SCHEDULE, "--steps", "12"]
    refit = ["--refit-fraction", "0.75"]
    for name, extra in (("straight", refit), ("plain", [])):
        ran = main_here("train", *args, *extra, "--no-db", "--devices", "cpu:1", "--batch-size", "128",
                        "--out-dir", str(tmp_path / name))
        assert ran.returncode == 0, ran.stderr
    split = [*args, *refit, "--devices", "cpu:2", "--batch-size", "64", "--out-dir", str(tmp_path / "split")]
    stopped = run_cli("train", *split, env={"SAE_DIST_TEST_TERM_RANK_AT": "1:5"})
    assert stopped.returncode != 0 and latest_checkpoint(tmp_path / "split").name == "step_00000006"
    assert "refit" in torch.load(latest_checkpoint(tmp_path / "split") / STATE, weights_only=False)
    done = run_cli("train", *split, "--resume")
    assert done.returncode == 0, done.stderr
    assert "decoder refit by least squares to the codes of the last 9 steps" in done.stdout + done.stderr
    straight, resumed, plain = decoder(tmp_path / "straight"), decoder(tmp_path / "split"), decoder(tmp_path / "plain")
    assert (resumed - straight).norm() / straight.norm() < 1e-5
    assert (plain - straight).norm() / straight.norm() > 1e-3  # the refit moved the decoder


@pytest.mark.parametrize("flags, words", [
    (["--refit-fraction", "2"], "refit_fraction: must be between 0 and 1, got 2.0"),
    (["--architecture", "jumprelu", "--refit-fraction", "0.2"], "the architecture is jumprelu"),
])
def test_a_bad_refit_is_one_line_and_exit_2(tmp_path, flags, words):
    ran = main_here("train", "--no-db", "--steps", "2", "--out-dir", str(tmp_path / "r"), *flags)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 2 and len(lines) == 1 and words in lines[0], ran.stderr
    assert not (tmp_path / "r").exists()


def test_a_sweeps_sae_refits_as_it_would_alone(tmp_path):
    """A sweep over the fraction on 2 ranks: its refit SAE's decoder equals the same SAE trained
    alone on 1 rank (the sweep's promise), and its unrefit one differs from it."""
    args = [*SMALL, "--checkpoint-every", "0", "--steps", "8", "--no-db"]
    alone = main_here("train", *args, "--refit-fraction", "0.5", "--devices", "cpu:1", "--batch-size", "128",
                      "--out-dir", str(tmp_path / "alone"))
    assert alone.returncode == 0, alone.stderr
    swept = run_cli("train", *args, "--sweep", "refit_fraction=0,0.5", "--devices", "cpu:2", "--batch-size", "64",
                    "--out-dir", str(tmp_path / "sweep"))
    assert swept.returncode == 0, swept.stderr
    straight = decoder(tmp_path / "alone")
    refit, plain = decoder(tmp_path / "sweep" / "saes" / "refit0.5"), decoder(tmp_path / "sweep" / "saes" / "refit0")
    assert (refit - straight).norm() / straight.norm() < 1e-5
    assert (plain - straight).norm() / straight.norm() > 1e-3

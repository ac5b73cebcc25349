"""SAEBench's core metrics (evaluate --json's "core"), by SAELens' names and formulas: checked
against SAELens' own explained-variance calculator and the lines of its
get_sparsity_and_variance_metrics, run by the real sae-lens on the same fixed numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sae_dist.evaluate.metrics import Accumulator

SAELENS_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from sae_lens.evals import ExplainedVarianceCalculator

root = Path(sys.argv[1])
t = load_file(str(root / "core.safetensors"))
x, out, acts = t["x"], t["x_hat"], t["acts"]
calc = ExplainedVarianceCalculator()
calc.add_batch(sae_output=out, hidden_acts=x)
# The lines of sae_lens.evals.get_sparsity_and_variance_metrics, for one batch of rows.
l2_norm_in = torch.norm(x, dim=-1)
l2_norm_out = torch.norm(out, dim=-1)
l2_norm_in_for_div = l2_norm_in.clone()
l2_norm_in_for_div[torch.abs(l2_norm_in_for_div) < 0.0001] = 1
x_hat_norm_squared = torch.norm(out, dim=-1) ** 2
x_dot_x_hat = (x * out).sum(dim=-1)
x_normed = x / torch.norm(x, dim=-1, keepdim=True)
x_hat_normed = out / torch.norm(out, dim=-1, keepdim=True)
density = (acts != 0).float().mean(0)
result = {
    "explained_variance": calc.compute(),
    "mse": (x - out).pow(2).sum(dim=-1).mean().item(),
    "cossim": (x_normed * x_hat_normed).sum(dim=-1).mean().item(),
    "l2_norm_in": l2_norm_in.mean().item(), "l2_norm_out": l2_norm_out.mean().item(),
    "l2_ratio": (l2_norm_out / l2_norm_in_for_div).mean().item(),
    "relative_reconstruction_bias": (x_hat_norm_squared.mean() / x_dot_x_hat.mean()).item(),
    "l0": (acts != 0).sum(dim=-1).float().mean().item(), "l1": acts.abs().sum(dim=-1).mean().item(),
    # SAEBench's (sae_bench/evals/core/main.py) from SAELens' feature density
    "frac_alive": (density > 0).float().mean().item(),
    "freq_over_1_percent": (density > 0.01).float().mean().item(),
    "freq_over_10_percent": (density > 0.1).float().mean().item(),
}
(root / "core.json").write_text(json.dumps(result))
"""


def fixed_numbers() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 24, generator=g) + 0.5
    x[7] = 1e-5  # a row under the norm floor: divided by 1 in the ratio (not 0: SAELens' cosine is then NaN)
    x_hat = 0.8 * x + 0.3 * torch.randn(300, 24, generator=g)
    x_hat[7] = 0.01
    acts = torch.relu(torch.randn(300, 64, generator=g) - 1.2)
    acts[:, :5] = 0.0  # never fired
    acts[:, 5] = 1.0  # fires on every row
    return {"x": x, "x_hat": x_hat, "acts": acts}


def prepare_saelens(root: Path) -> tuple[str, list]:
    save_file(fixed_numbers(), str(root / "core.safetensors"))
    return SAELENS_SCRIPT, [root]


def ours(t: dict[str, torch.Tensor]) -> dict:
    acc = Accumulator(t["acts"].shape[1])
    acc.add(t["x"], t["x_hat"], t["acts"])
    return acc.result().to_dict()["core"]


def test_core_metrics_on_plain_numbers():
    core = ours(fixed_numbers())
    assert core["frac_alive"] < 1 and core["freq_over_10_percent"] > 0
    assert 0 < core["l2_ratio"] < 1.5 and 0.5 < core["relative_reconstruction_bias"] < 1.5
    assert set(core) == {"explained_variance", "mse", "cossim", "l2_norm_in", "l2_norm_out", "l2_ratio",
                         "relative_reconstruction_bias", "l0", "l1", "frac_alive", "freq_over_1_percent",
                         "freq_over_10_percent"}


@pytest.mark.slow
@pytest.mark.saelens
def test_core_metrics_are_saelens_own_formulas(tmp_path_factory):
    from saelens_once import saelens_folder

    root = saelens_folder("core", tmp_path_factory)
    theirs = json.loads((root / "core.json").read_text())
    mine = ours(load_file(str(root / "core.safetensors")))
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        assert mine[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name

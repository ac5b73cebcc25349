"""scripts/truth_start.py: the SAE the trainer builds starts at the synthetic source's planted
dictionary, in the layout the architecture asks for, and a config it cannot start that way is
one line and a failure."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from conftest import REPO
from sae_dist.config import TrainConfig

spec = importlib.util.spec_from_file_location("truth_start", REPO / "scripts" / "truth_start.py")
truth_start = importlib.util.module_from_spec(spec)
spec.loader.exec_module(truth_start)

# 32 parents with 2 children each: 96 features.
HIERARCHY = dict(source="synthetic", d_in=32, synthetic_features=96, synthetic_active=3.0, synthetic_children=2,
                 synthetic_child_prob=1.0, k=6)


def test_matryoshka_starts_with_the_parents_in_the_inner_prefix_and_the_children_after_it():
    cfg = TrainConfig(**HIERARCHY, d_sae=256, architecture="matryoshka")
    truth, parents = truth_start.truth_rows(cfg)
    assert parents == 32 and truth.shape == (96, 32)
    sae = truth_start.build_at_truth(cfg, "cpu")
    inner = cfg.resolved_matryoshka_widths[0]
    assert inner == 64  # the default inner prefix, d_sae/4: room for the parents and random rows
    torch.testing.assert_close(sae.W_dec[:parents], truth[:parents])
    torch.testing.assert_close(sae.W_dec[inner:inner + 64], truth[parents:])
    torch.testing.assert_close(sae.W_enc, sae.W_dec.t())
    # The rows between keep their random start: none of them is a planted feature.
    between = torch.nn.functional.normalize(sae.W_dec[parents:inner], dim=1) @ truth.t()
    assert between.abs().max() < 0.9


def test_topk_starts_with_the_features_in_order():
    cfg = TrainConfig(**HIERARCHY, d_sae=128, architecture="topk")
    truth, _ = truth_start.truth_rows(cfg)
    sae = truth_start.build_at_truth(cfg, "cpu")
    torch.testing.assert_close(sae.W_dec[:96], truth)


@pytest.mark.parametrize(("change", "said"), [
    (dict(source="shards", shards_path="/nowhere"), "the truth is the synthetic source's planted dictionary"),
    (dict(d_sae=64), "96 planted features (32 parents) do not fit d_sae 64 with the children from row 16 on"),
])
def test_a_config_it_cannot_start_at_the_truth_is_one_line(change, said):
    cfg = TrainConfig(**{**HIERARCHY, "d_sae": 256, "architecture": "matryoshka", **change})
    with pytest.raises(SystemExit, match=re.escape(said)) as stop:
        truth_start.build_at_truth(cfg, "cpu")
    assert "\n" not in str(stop.value.code)

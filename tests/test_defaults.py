"""The rule-based defaults (sae_dist.defaults) pinned with plain numbers: the lr rule fitted on the
sweep in scripts/sweep_lr.py, the warm-up and decay, the dead-latent window, and how a config
resolves them (keeping whatever it was given)."""

from __future__ import annotations

import pytest

from sae_dist.config import TrainConfig
from sae_dist.defaults import default_dead_after_samples, default_lr, default_warmup_steps, describe_resolved


@pytest.mark.parametrize("d_in,lr", [(64, 3.6e-3), (256, 1.8e-3), (384, 1.4697e-3), (1024, 9e-4), (4096, 4.5e-4)])
def test_the_lr_rule_falls_with_the_square_root_of_d_in(d_in, lr):
    assert default_lr(1024, 4096, 16, d_in) == pytest.approx(lr, rel=1e-4)
    # No term for the batch, d_sae or k: the sweep had too few shapes to fit one.
    assert default_lr(8192, 65536, 128, d_in) == default_lr(256, 1024, 8, d_in)


def test_matryoshka_learns_at_twice_the_rule():
    assert default_lr(1024, 4096, 16, 256, "matryoshka") == pytest.approx(3.6e-3)
    assert default_lr(1024, 4096, 16, 256, "batchtopk") == default_lr(1024, 4096, 16, 256) == pytest.approx(1.8e-3)
    assert TrainConfig(architecture="matryoshka", d_in=256, steps=100).resolved(1).lr == 3.6e-3
    assert TrainConfig(architecture="matryoshka", d_in=256, steps=100, lr=1e-3).resolved(1).lr == 1e-3
    # ... and --lr's help says so (it once gave TopK's rule alone)
    import dataclasses

    lr_help = next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == "lr")
    assert "default 0.0018 x sqrt(256 / d_in), 2 times that for matryoshka" in lr_help


@pytest.mark.parametrize("steps,warmup", [(10, 0), (100, 5), (1024, 51), (20_000, 1000), (1_000_000, 1000)])
def test_warmup_is_5_percent_of_the_steps_at_most_1000(steps, warmup):
    assert default_warmup_steps(steps) == warmup


@pytest.mark.parametrize("samples,batch,window", [
    (1_048_576, 1024, 104_857),  # a tenth of a 1M-sample run: AuxK acts after ~100 steps
    (1000, 512, 512),  # never less than one step's batch
    (10**9, 4096, 10_000_000),  # long runs keep the usual 10M
])
def test_the_dead_window_is_a_tenth_of_the_run_bounded(samples, batch, window):
    assert default_dead_after_samples(samples, batch) == window


def test_a_config_resolves_the_rules_for_its_global_batch_and_keeps_what_it_was_given():
    cfg = TrainConfig(d_in=256, d_sae=4096, k=16, batch_size=512, grad_accum=2, steps=1024)
    r = cfg.resolved(world_size=2)  # global batch 2048: 2,097,152 samples
    assert (r.lr, r.lr_warmup_steps, r.lr_decay_fraction, r.dead_after_samples) == (1.8e-3, 51, 0.2, 209_715)
    given = TrainConfig(d_in=256, steps=1024, lr=1e-2, lr_warmup_steps=7, lr_decay_fraction=0.0,
                        dead_after_samples=123)
    r = given.resolved(world_size=4)
    assert (r.lr, r.lr_warmup_steps, r.lr_decay_fraction, r.dead_after_samples) == (1e-2, 7, 0.0, 123)
    assert describe_resolved(given, r) == ("lr 0.01, warm-up 7 steps, decay to 0 over the last 0% of the steps, "
                                           "dead after 123 samples without firing, no decoder refit (default), "
                                           "no rare-latent bias (default)")
    assert "lr 0.0018 (default)" in describe_resolved(cfg, cfg.resolved(1))


@pytest.mark.parametrize("settings, fraction", [
    ({"architecture": "matryoshka", "d_sae": 4096}, 0.2),  # Matryoshka refits by default...
    ({"architecture": "matryoshka", "d_sae": 16_384}, 0.2),
    ({"architecture": "matryoshka", "d_sae": 16_385}, 0.0),  # ...up to the size whose solve is 6.4 GB
    ({"architecture": "matryoshka", "d_sae": 65_536, "refit_fraction": 0.5}, 0.5),  # asked for: always
    ({"architecture": "matryoshka", "d_sae": 4096, "refit_fraction": 0.0}, 0.0),
    ({"architecture": "topk", "d_sae": 4096}, 0.0),  # TopK's results stay as measured
    ({"architecture": "batchtopk", "d_sae": 4096}, 0.0),
    ({"architecture": "standard", "d_sae": 4096}, 0.0),
])
def test_the_decoder_refit_is_matryoshkas_default_up_to_a_size(settings, fraction):
    cfg = TrainConfig(d_in=256, k=16, steps=100, **settings)
    resolved = cfg.resolved(world_size=1)
    assert cfg.resolved_refit_fraction == resolved.refit_fraction == fraction
    described = describe_resolved(cfg, resolved)
    assert (f"decoder refit to the last {fraction:.0%} of the steps" if fraction else "no decoder refit") in described
    refit_part = next(part for part in described.split(", ") if "decoder refit" in part)
    assert refit_part.endswith("(default)") == ("refit_fraction" not in settings)


@pytest.mark.parametrize("architecture, fraction", [("batchtopk", 0.2), ("matryoshka", 0.2), ("jumprelu", 0.0),
                                                    ("standard", 0.0)])
def test_a_topk_family_transcoder_is_refit_by_default(architecture, fraction):
    selection = {"matryoshka_selection": "batch"} if architecture == "matryoshka" else {}
    cfg = TrainConfig(d_in=256, d_sae=4096, k=16, architecture=architecture, source="shards", shards_path="x",
                      transcode="a:b", **selection)
    assert cfg.resolved_refit_fraction == fraction
    assert TrainConfig(d_in=256, d_sae=16_385, k=16, architecture=architecture, source="shards", shards_path="x",
                       transcode="a:b", **selection).resolved_refit_fraction == 0.0

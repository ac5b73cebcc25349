"""Train an SAE with sae-dist's own trainer, its decoder started at the planted truth.

What does a training objective keep when it begins at the answer? This runs
`python -m sae_dist train` with the flags given, on the synthetic source, but the SAE it builds
starts with the planted dictionary of that source as decoder rows (unit norm) and their
transposes as encoder columns; everything else is the trainer's as the flags say, and
everything trains. A planted feature that the run ends without is one the objective itself
moves away from, not one it failed to find.

Where the rows go: for Matryoshka, the parents fill the first rows (inside the inner prefix)
and the children start at the inner prefix's end, the layout the nested loss asks for; for the
other architectures, the features in order (parents first) in the first rows. The rest of the
rows keep their random start.

    .venv/bin/python scripts/truth_start.py --no-db --devices cpu:1 --source=synthetic \\
        --synthetic-children=2 ... --architecture=matryoshka --out-dir=OUT

Not a feature of the trainer: an experiment, for docs/quality.md. The CPU ranks are forked from
this process (as from `python -m sae_dist`), so they inherit the start.
"""

from __future__ import annotations

import sys

import torch

from sae_dist.cli import main
from sae_dist.config import TrainConfig
from sae_dist.data.sources.make import make_source
from sae_dist.distributed import DistContext
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train import members

trainers_build = members.build_sae


def truth_rows(cfg: TrainConfig) -> tuple[torch.Tensor, int]:
    """The planted dictionary of the source `cfg` describes (unit rows, parents first) and how
    many of its rows are parents."""
    # The trainer's own source; its dictionary is drawn from the seed alone, the same on every rank.
    source = make_source(cfg, DistContext(0, 1, 0, torch.device("cpu"), "none"))
    return torch.nn.functional.normalize(source.dictionary.float(), dim=1), source.parents


def build_at_truth(cfg: TrainConfig, device) -> SparseAutoencoder:
    if cfg.source != "synthetic":
        raise SystemExit("truth_start.py: the truth is the synthetic source's planted dictionary (--source=synthetic)")
    sae = trainers_build(cfg, device)
    truth, parents = truth_rows(cfg)
    # Matryoshka: children from the inner prefix's end on, so that the prefix holds the parents alone.
    children_at = cfg.resolved_matryoshka_widths[0] if cfg.architecture == "matryoshka" else parents
    if children_at + truth.shape[0] - parents > sae.W_dec.shape[0] or children_at < parents:
        raise SystemExit(f"truth_start.py: {truth.shape[0]} planted features ({parents} parents) do not fit "
                         f"d_sae {sae.W_dec.shape[0]} with the children from row {children_at} on")
    with torch.no_grad():
        sae.W_dec[:parents].copy_(truth[:parents])
        sae.W_dec[children_at:children_at + truth.shape[0] - parents].copy_(truth[parents:])
        sae.W_enc.copy_(sae.W_dec.t())
    print(f"started at the truth: {parents} parents in rows 0-{parents - 1}, "
          f"{truth.shape[0] - parents} children from row {children_at}", flush=True)
    return sae


if __name__ == "__main__":
    members.build_sae = build_at_truth
    sys.exit(main(["train", *sys.argv[1:]]))

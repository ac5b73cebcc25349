"""Evaluate any SAE: reconstruction (FVU, explained variance, MSE, cosine), sparsity (L0, dead and
dense latents, the feature-density histogram) and, on planted data, dictionary recovery.

    sae = load_sae("runs/x/sae")                       # SAELens format: ours or SAELens' own
    ev = evaluate_sae(sae, heldout_batches("acts/", 16384), load_planted("acts/"))
    ev = evaluate_shards(sae, "acts/", 16384)            # the same, batches sized to d_sae
    print(ev.to_dict())

`evaluate_sae` takes anything with encode / decode / W_dec / d_sae, so the trainer evaluates its
in-memory SparseAutoencoder the same way.
"""

from sae_dist.evaluate.data import DEFAULT_ROWS, batch_rows_for, evaluate_shards, heldout_batches, heldout_rows
from sae_dist.evaluate.load import LoadedSae, load_sae
from sae_dist.evaluate.metrics import (
    DENSITY_EDGES,
    Accumulator,
    Density,
    Evaluation,
    Planted,
    Recovery,
    best_cosines,
    density_histogram,
    evaluate_sae,
    recovery,
)
from sae_dist.evaluate.planted import (
    load_planted,
    planted_from_settings,
    presence_frequencies,
    write_planted_shards,
)

__all__ = [
    "DEFAULT_ROWS",
    "DENSITY_EDGES",
    "Accumulator",
    "Density",
    "Evaluation",
    "LoadedSae",
    "Planted",
    "Recovery",
    "batch_rows_for",
    "best_cosines",
    "density_histogram",
    "evaluate_sae",
    "evaluate_shards",
    "heldout_batches",
    "heldout_rows",
    "load_planted",
    "load_sae",
    "planted_from_settings",
    "presence_frequencies",
    "recovery",
    "write_planted_shards",
]

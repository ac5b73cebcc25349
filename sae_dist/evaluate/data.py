"""The rows an SAE is evaluated on: the tail of a shard set, read through memory maps in batches."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import Tensor

from sae_dist.data.sources.shards import open_shards, tail_batches
from sae_dist.errors import DataError
from sae_dist.evaluate.metrics import Evaluable, Evaluation, evaluate_sae
from sae_dist.evaluate.planted import load_planted

DEFAULT_ROWS = 16384
BATCH_ROWS = 4096
BATCH_LATENTS = 2**25  # rows x d_sae per batch: the dense activations stay near 128 MiB in fp32


def batch_rows_for(d_sae: int) -> int:
    """Rows per evaluation batch for an SAE of d_sae latents (encode makes a dense [rows, d_sae])."""
    return max(1, min(BATCH_ROWS, BATCH_LATENTS // max(1, d_sae)))


def _check_rows(rows: int) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise DataError(f"rows {rows}: at least one row is needed to evaluate (0 rows selected)")


def heldout_batches(shards_dir: str | os.PathLike, rows: int = DEFAULT_ROWS, batch_rows: int = BATCH_ROWS,
                    d_in: int | None = None) -> Iterator[Tensor]:
    """The last `rows` rows of a shard set (all of them if it has fewer), as float32 batches of at
    most `batch_rows`, in row order. The trainer holds out this tail; only its pages are read.

    Checks up front (before yielding): the directory, rows >= 1, and the width against `d_in`.
    """
    _check_rows(rows)
    ds = open_shards(shards_dir)
    if d_in is not None and ds.d_in != d_in:
        from sae_dist.data.shard_format import shard_pair

        paired = shard_pair(ds.manifest) is not None
        if paired or ds.d_in == 2 * d_in:
            raise DataError(f"{ds.directory} holds rows of width {ds.d_in}"
                            f"{' (pairs for a transcoder)' if paired else ''}, but the SAE reads "
                            f"{d_in} wide rows: evaluate an SAE on one site's shards, a transcoder on its pairs")
        raise DataError(f"{ds.directory} holds activations of width {ds.d_in}, but the SAE reads d_in={d_in}: "
                        f"evaluate it on shards of its own activation site")
    return tail_batches(ds, min(rows, ds.total_rows), batch_rows)


def heldout_rows(shards_dir: str | os.PathLike, rows: int = DEFAULT_ROWS) -> Tensor:
    """The last `rows` rows of a shard set as one float32 tensor [min(rows, total), d_in]."""
    batches = list(heldout_batches(shards_dir, rows))
    if not batches:
        raise DataError(f"{shards_dir}: no rows to evaluate on")
    return torch.cat(batches)


def evaluate_shards(sae: Evaluable, shards_dir: str | os.PathLike, rows: int = DEFAULT_ROWS) -> Evaluation:
    """`sae` on the last `rows` rows of a shard directory, with its planted dictionary if it has one."""
    d_in = int(getattr(sae, "row_width", getattr(sae, "d_in", sae.W_dec.shape[1])))  # a transcoder's pairs
    # Checks the shards and their width before any row is read.
    batches = heldout_batches(shards_dir, rows, batch_rows_for(int(sae.d_sae)), d_in=d_in)
    planted = load_planted(shards_dir)
    if planted is not None:  # planted rows are stream positions 0..total-1: the tail's first is
        total = open_shards(shards_dir).total_rows
        planted.first_row = total - min(rows, total)
    return evaluate_sae(sae, batches, planted)

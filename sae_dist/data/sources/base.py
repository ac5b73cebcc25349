"""What the trainer asks of a data source, whichever it is (synthetic, shards or a model).

Every source is one stream shared by every rank: a step takes the next global batch of it, and
each rank reads its slice of each micro-batch (sae_dist.train.balance.BatchPlan). So a step's samples
never depend on the number of ranks or their shares, and the stream's position is the same on
every rank (a checkpoint keeps rank 0's). The end-of-run evaluation also reads rows the run never
trained on, each source its own way (`unseen_rows`, read by sae_dist.evaluate.end_of_run).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass
class UnseenRows:
    """Rows a run never trained on, for its end-of-run evaluation."""

    batches: Iterable[Tensor]  # float32 [at most batch_rows, d_in] on the CPU, read as they are iterated
    where: str  # which rows, in a few words ("the shards' held-out tail (200 rows no batch drew)")
    # The first row's place in the data (the synthetic stream's position, or a shard set's row): with
    # planted data, where its ground truth is.
    first_row: int | None = None


class ActivationSource(Protocol):
    d_in: int  # the width of a row

    @property
    def planted_features(self) -> Tensor | None:
        """The true dictionary [features, d_in] when the data was made from one (feature recovery is
        then measured during training); None for real activations."""

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Rank's slice of each micro-batch of the next step of the stream."""

    def next_batch(self, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
        """This rank's equal part of the next batch (the benchmark's steps: no shares)."""

    def use_global_batch(self, global_batch: int) -> None:
        """Steps take `global_batch` rows from now on (a resumed run keeps its checkpoint's)."""

    def state_dict(self) -> dict[str, Any]:
        """The stream's position: continuing from it gives exactly the rows that come next."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def unseen_rows(self, rows: int, batch_rows: int, ctx, plan) -> UnseenRows | None:
        """About `rows` rows the run never trained on, in batches of at most `batch_rows`. Every rank
        calls it once the run is over (the model source draws them collectively, in whole steps of
        `plan`, a sae_dist.train.balance.BatchPlan); rank 0 gets them, the others None. None too when the
        source has none (shards hold out their tail from the start, sized by the config)."""

"""What the trainer asks of a data source, whichever it is (synthetic, shards or a model).

Every source is one stream shared by every rank: a step takes the next global batch of it, and
each rank reads its slice of each micro-batch (sae_dist.balance.BatchPlan). So a step's samples
never depend on the number of ranks or their shares, and the stream's position is the same on
every rank (a checkpoint keeps rank 0's). The end-of-run evaluation also reads rows the run never
trained on, in a way of each source's own (sae_dist.evaluate.end_of_run).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


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

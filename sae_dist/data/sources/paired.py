"""A transcoder's rows: its input and its target side by side, [x | y], each d_in wide.

Paired shards hold such rows as written (`harvest --transcode IN:OUT`, `pair-shards`), their
manifest naming the pair ("pair": [IN, OUT]; read without torch by sae_dist.data.shard_format);
the model source hooks both sites in one forward pass and gives [rows, 2, d_in], laid flat here.
Either way every part of the trainer that moves rows (the shuffle, the ranks' shares, the held-out
tail) moves whole pairs, and the SAE splits them (sae_dist.models.sae)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from sae_dist.data.shard_format import PAIR_KEY, shard_pair
from sae_dist.errors import DataError


class PairedRows:
    """How an SAE or a transcoder (an object with `d_in` and `transcoder`) reads a row: an SAE's row
    is its input and its target alike; a transcoder's is [x | y]. Shared by the trained module
    (sae_dist.models.sae) and an SAE read from disk (sae_dist.evaluate.load)."""

    d_in: int
    transcoder: bool

    @property
    def row_width(self) -> int:
        return 2 * self.d_in if self.transcoder else self.d_in

    def split(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """(what the encoder reads, what the output must match)."""
        if self.transcoder:
            return rows[..., :self.d_in], rows[..., self.d_in:]
        return rows, rows


class PairedSource:
    """A source of [x | y] rows as the trainer sees it: `d_in` is the input's width, and the model
    source's [rows, 2, d_in] come out flat (paired shards' rows are flat already). It offers no
    `sites`: its rows are one stream of pairs, not sites for a sweep's SAEs to take apart."""

    sites: tuple = ()

    def __init__(self, inner, d_in: int):
        self.inner, self.d_in = inner, d_in

    def __getattr__(self, name: str) -> Any:  # the stream's position, memory, planted features...
        return getattr(self.inner, name)

    @staticmethod
    def _flat(rows: Tensor) -> Tensor:
        return rows.reshape(rows.shape[0], -1)

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        return [self._flat(x) for x in self.inner.next_batches(plan, rank, device, dtype)]

    def next_batch(self, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
        return self._flat(self.inner.next_batch(device, dtype))

    def unseen_rows(self, rows: int, batch_rows: int, ctx, plan):
        unseen = self.inner.unseen_rows(rows, batch_rows, ctx, plan)
        return None if unseen is None else dataclasses.replace(unseen, batches=[self._flat(b) for b in unseen.batches])

    def site_of(self, layer: int, site: str) -> None:
        return None


def pair_shards(inputs: str, targets: str, out: str, names: tuple[str, str] | None = None,
                rows_per_shard: int = 65536) -> tuple[int, tuple[str, str]]:
    """Write paired shards [x | y] from an input shard set and a target set whose rows match one
    to one (the same tokens, in the same order); (rows written, the pair's names). The names are
    `names`, or each set's harvested site, or "input" and "target"."""
    from sae_dist.data.shard_format import write_shards
    from sae_dist.data.sources.shards import open_shards, read_rows

    a, b = open_shards(inputs), open_shards(targets)
    if a.directory.resolve() == b.directory.resolve():
        raise DataError(f"{inputs} is both the input and the target: pair two different shard sets")
    for ds in (a, b):
        if shard_pair(ds.manifest):
            raise DataError(f"{ds.directory} is paired already; pair two sets of one site each")
    if a.total_rows != b.total_rows:
        raise DataError(f"paired shards need the same rows: {a.directory} holds {a.total_rows:,} rows, "
                        f"{b.directory} {b.total_rows:,}")
    if a.d_in != b.d_in:
        raise DataError(f"paired shards need one width: {a.directory} is {a.d_in} wide, {b.directory} {b.d_in} "
                        f"(sae-dist's transcoders map a site to another of the same width)")
    if names is None:
        names = (str(a.manifest.get("site", "input")), str(b.manifest.get("site", "target")))
        if names[0] == names[1]:
            names = ("input", "target")
    dtype = a.dtype if a.dtype == b.dtype else torch.float32
    chunks = (torch.cat([read_rows(a, lo, min(lo + rows_per_shard, a.total_rows), dtype),
                         read_rows(b, lo, min(lo + rows_per_shard, a.total_rows), dtype)], dim=1)
              for lo in range(0, a.total_rows, rows_per_shard))
    write_shards(out, chunks, {PAIR_KEY: list(names), "paired_from": [str(a.directory), str(b.directory)]})
    return a.total_rows, names

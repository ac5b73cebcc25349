"""The `shards` activation source: a directory of safetensors files that N DDP ranks stream from.

Why it exists: harvested activations are larger than RAM (many millions of rows x d_in), every
rank reads its own slice of each step, and SGD wants the rows shuffled. So:

* files are memory-mapped, never loaded: a random row gather faults in only the pages it touches;
* the shuffle works on row *indices* and gives exact epochs (every row once a pass; a uniform draw
  from a rolling buffer repeats some rows and skips as many). Each epoch shuffles the order of
  blocks of contiguous rows, cuts that order into windows of about buffer_rows rows and shuffles
  the rows within each window, all seeded by (seed, epoch, window). Reads stay local to a window of
  blocks while a batch still mixes rows from far apart, and batches are consecutive slices of it;
* the whole stream state is one integer (rows taken so far) and the settings that fix the order,
  so a run resumed from a checkpoint gets exactly the batches the uninterrupted run would have;
* an optional held-out tail (the last holdout_rows rows) is never trained on: the evaluation at
  the end of a run reads it through ShardStream.unseen_rows.

The directory's layout, its validation and its writers are in sae_dist.data.shard_format.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sae_dist.data.shard_format import REDO, ShardLayout, dtype_name, read_layout
from sae_dist.data.sources.base import UnseenRows
from sae_dist.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class ShardDataset(ShardLayout):
    """What open_shards found (sae_dist.data.shard_format.ShardLayout), with its dtype as torch's."""

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)


def open_shards(directory: str | os.PathLike, verify_checksums: bool = False) -> ShardDataset:
    """Validate a shard directory from the file headers (and manifest.json if present), reading no data.

    verify_checksums additionally reads every file and compares it with the manifest's sha256.
    """
    return ShardDataset(**vars(read_layout(directory, verify_checksums)))


# ----------------------------------------------------------------------------------------------
# Streaming


def _seed_for(*parts: Any) -> int:
    # A stable hash (unlike hash()) so that (seed, rank, epoch, ...) always gives the same generator.
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _shared(error: DataError) -> DataError:
    # Every rank loads the same stream state, so every rank raises this alike: rank 0 reports it.
    error.shared = True
    return error


def _map_rows(path: Path, data_start: int, rows: int, d_in: int, dtype: torch.dtype) -> Tensor:
    """[rows, d_in] view of a file's activations through a private, lazy memory map."""
    data_end = data_start + rows * d_in * dtype.itemsize
    try:
        raw = torch.from_file(str(path), shared=False, size=data_end, dtype=torch.uint8)
    except RuntimeError as e:
        raise DataError(f"{path}: cannot be memory-mapped ({e}); was it truncated or replaced after "
                        f"opening? {REDO}") from e
    data = raw[data_start:data_end]
    if data_start % dtype.itemsize:
        # A view needs an aligned start; safetensors pads its header so this is rare (hand-made files).
        log.warning("%s: activations start at byte %d, not aligned for %s; reading the file into memory "
                    "instead of mapping it", path, data_start, dtype_name(dtype))
        data = data.clone()
    return data.view(dtype).view(rows, d_in)


def read_rows(dataset: ShardDataset, start: int, stop: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Global rows [start, stop) of a dataset, in order, as a new [stop - start, d_in] tensor of dtype.

    Maps only the files those rows lie in. For evaluation on rows a run did not train on, see
    ShardStream.heldout_rows.
    """
    if not 0 <= start <= stop <= dataset.total_rows:
        raise ValueError(f"rows [{start}, {stop}) are not within the {dataset.total_rows} rows of "
                         f"{dataset.directory}")
    out = torch.empty(stop - start, dataset.d_in, dtype=dtype)
    first = 0
    for path, rows, offset in zip(dataset.files, dataset.rows, dataset.data_offsets):
        lo, hi = max(start, first), min(stop, first + rows)
        if lo < hi:
            view = _map_rows(path, offset, rows, dataset.d_in, dataset.dtype)
            out[lo - start:hi - start].copy_(view[lo - first:hi - first])
        first += rows
    return out


def tail_batches(dataset: ShardDataset, count: int, batch_rows: int) -> Iterator[Tensor]:
    """The last `count` rows of a dataset, in order, as float32 batches of at most `batch_rows`
    (a batch never spans two files); only the pages of those rows are read."""
    first = dataset.total_rows - count  # global index of the first row wanted
    starts = [0, *itertools.accumulate(dataset.rows)]
    for path, file_rows, offset, file_start in zip(dataset.files, dataset.rows, dataset.data_offsets, starts):
        if file_start + file_rows <= first:
            continue
        view = _map_rows(path, offset, file_rows, dataset.d_in, dataset.dtype)
        lo = max(first - file_start, 0)
        for i in range(lo, file_rows, batch_rows):
            yield view[i:min(i + batch_rows, file_rows)].to(torch.float32, copy=True)  # not a view of the map


class ShardStream:
    """Infinite, shuffled, exactly resumable batches of one part of a ShardDataset, in exact epochs.

    The stream trains on global rows [0, T - holdout_rows) (the tail is kept for evaluation); rank r
    of world_size W owns rows [r*N//W, (r+1)*N//W) of those N. (The trainer runs one stream with
    W = 1 on every rank, batch_size = the global batch, and each rank reads its slice of a step.)

    Each epoch is a permutation of the part: its blocks of block_rows contiguous rows are put in
    an order seeded by (seed, rank, epoch); consecutive groups of buffer_rows // block_rows blocks
    of that order are windows, and each window's rows are shuffled by a generator seeded by (seed,
    rank, epoch, window). The stream is those epochs one after the other, and a batch is its next
    batch_size rows (one may hold the end of an epoch and the start of the next). So every row is
    drawn exactly once an epoch, and the position (rows taken so far) is the whole state.
    """

    def __init__(self, dataset: ShardDataset, rank: int, world_size: int, batch_size: int, seed: int,
                 buffer_rows: int = 65536, block_rows: int = 2048, holdout_rows: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if min(batch_size, buffer_rows, block_rows) < 1:
            raise ValueError("batch_size, buffer_rows and block_rows must be positive")
        if holdout_rows < 0:
            raise ValueError(f"holdout_rows must be 0 or more, got {holdout_rows}")
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.batch_size, self.seed = batch_size, seed
        self.buffer_rows, self.block_rows, self.holdout_rows = buffer_rows, block_rows, holdout_rows
        total = dataset.total_rows
        train = total - holdout_rows
        if train < 1:
            raise DataError(f"{dataset.directory} has {total} rows; holding out {holdout_rows} of them for "
                            f"evaluation leaves none to train on; hold out fewer rows")
        self._lo, self._hi = rank * train // world_size, (rank + 1) * train // world_size
        self._part = part = self._hi - self._lo
        self._check_batch(batch_size)
        self._num_blocks = -(-part // block_rows)
        self._window_blocks = max(1, buffer_rows // block_rows)
        self._offsets = torch.arange(block_rows)
        self._starts, self._ends, self._views = self._map_files()
        self._pos = 0  # rows taken so far, over all epochs: the stream's whole state
        self._plan_epoch, self._order, self._window_starts = -1, torch.empty(0, dtype=torch.int64), [0]
        self._window_key, self._window = (-1, -1), torch.empty(0, dtype=torch.int64)

    def _check_batch(self, batch_size: int) -> None:
        part, total, ds = self._part, self.dataset.total_rows, self.dataset
        if part >= batch_size:
            return
        if self.holdout_rows:
            ranks = f", so rank {self.rank} of {self.world_size} gets {part}" if self.world_size > 1 else ""
            raise DataError(f"{ds.directory} has {total} rows; holding out the last {self.holdout_rows} for "
                            f"evaluation leaves {total - self.holdout_rows} to train on{ranks}, fewer than one "
                            f"batch of {batch_size}; hold out fewer rows, use a smaller batch, or more data")
        raise DataError(f"{ds.directory} has {total} rows, so rank {self.rank} of {self.world_size} gets "
                        f"{part}, fewer than one batch of {batch_size}: {self.world_size} devices x batch "
                        f"{batch_size} needs at least {self.world_size * batch_size} rows; use fewer "
                        f"devices, a smaller batch, or more data")

    @property
    def d_in(self) -> int:
        return self.dataset.d_in

    @property
    def planted_features(self) -> None:
        return None  # planted shards are measured against their dictionary at the end of a run

    @property
    def epoch(self) -> int:
        """The epoch the last row taken belongs to (0 during the first, up to and with its last row)."""
        return (self._pos - 1) // self._part if self._pos else 0

    @property
    def rows_seen(self) -> int:
        """Rows taken so far, over all epochs."""
        return self._pos

    def _map_files(self) -> tuple[list[int], Tensor, list[Tensor | None]]:
        """First global row of each file, end rows (for searchsorted), and views of the files this part reads."""
        ds = self.dataset
        starts = [0, *itertools.accumulate(ds.rows)][:-1]
        ends = torch.tensor([s + r for s, r in zip(starts, ds.rows)], dtype=torch.int64)
        views: list[Tensor | None] = []
        for path, rows, offset, start in zip(ds.files, ds.rows, ds.data_offsets, starts):
            overlaps = start < self._hi and start + rows > self._lo  # only those are mapped
            views.append(_map_rows(path, offset, rows, ds.d_in, ds.dtype) if overlaps else None)
        return starts, ends, views

    # -- the order: O(blocks) once an epoch, O(window) once a window, O(batch) a batch ---------------

    def _epoch_plan(self, epoch: int) -> list[int]:
        """The epoch's block order (cached) and where each window starts in the epoch, in rows."""
        if self._plan_epoch != epoch:
            gen = torch.Generator().manual_seed(_seed_for(self.seed, self.rank, "blocks", epoch))
            order = torch.randperm(self._num_blocks, generator=gen)
            lengths = torch.full((self._num_blocks,), self.block_rows, dtype=torch.int64)
            lengths[-1] = self._part - (self._num_blocks - 1) * self.block_rows  # only the last is short
            ends = lengths[order].cumsum(0)[self._window_blocks - 1::self._window_blocks].tolist()
            if len(ends) * self._window_blocks < self._num_blocks:
                ends.append(self._part)  # a last, smaller window
            self._plan_epoch, self._order, self._window_starts = epoch, order, [0, *ends]
        return self._window_starts

    def _window_rows(self, epoch: int, window: int) -> Tensor:
        """Global row indices of one window of an epoch, in their shuffled order (cached)."""
        if self._window_key != (epoch, window):
            self._epoch_plan(epoch)
            blocks = self._order[window * self._window_blocks:(window + 1) * self._window_blocks]
            rows = ((self._lo + blocks * self.block_rows).unsqueeze(1) + self._offsets).flatten()
            if bool((blocks == self._num_blocks - 1).any()):
                rows = rows[rows < self._hi]  # the short last block
            gen = torch.Generator().manual_seed(_seed_for(self.seed, self.rank, "rows", epoch, window))
            self._window = rows[torch.randperm(len(rows), generator=gen)]
            self._window_key = (epoch, window)
        return self._window

    def _take(self, count: int) -> Tensor:
        """The next `count` global row indices of the stream, in its order; advances the position."""
        pieces = []
        while count:
            epoch, at = divmod(self._pos, self._part)
            starts = self._epoch_plan(epoch)
            window = bisect.bisect_right(starts, at) - 1
            rows = self._window_rows(epoch, window)
            begin = at - starts[window]
            piece = rows[begin:begin + count]
            pieces.append(piece)
            self._pos += len(piece)
            count -= len(piece)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def use_global_batch(self, batch_size: int) -> None:
        """Take `batch_size` rows a step from now on: a run that continues on other devices keeps
        its checkpoint's global batch, which may differ from its configured one."""
        self._check_batch(batch_size)
        self.batch_size = batch_size

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Rank's slice of each micro-batch of the next step (a sae_dist.train.balance.BatchPlan).

        Every rank runs the same whole-data stream with batch_size = the global batch and reads only
        its slice: a step's samples do not depend on the number of ranks or their shares.
        """
        if plan.global_batch != self.batch_size:
            raise ValueError(f"stream batch {self.batch_size} is not the plan's global batch {plan.global_batch}")
        indices, _ = self._take(self.batch_size).sort()  # sorted: each slice reads a narrower range
        out = []
        pinned = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        for j in range(plan.micro_steps):
            lo = j * plan.micro_batch + plan.offset(rank)
            mine = indices[lo:lo + plan.shares[rank]]
            x = torch.empty(len(mine), self.dataset.d_in, dtype=dtype, pin_memory=pinned)
            self._gather(mine, x)
            out.append(x if device is None else x.to(device, non_blocking=pinned))
        return out

    # -- data ----------------------------------------------------------------------------------

    def next_batch(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """The next [batch_size, d_in] batch, converted to dtype (and moved to device if given)."""
        indices, _ = self._take(self.batch_size).sort()  # sorted: one contiguous run per file, and page locality
        pinned = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()
        out = torch.empty(self.batch_size, self.dataset.d_in, dtype=dtype, pin_memory=pinned)
        self._gather(indices, out)
        return out if device is None else out.to(device, non_blocking=pinned)

    def heldout_rows(self, limit: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """The held-out tail (the last holdout_rows rows, which no batch of the stream holds), in
        order, as [n, d_in]: all of it, or its last `limit` rows (the data set's last rows either way,
        as `sae_dist.evaluate` reads them)."""
        count = self.holdout_rows if limit is None else max(0, min(limit, self.holdout_rows))
        total = self.dataset.total_rows
        return read_rows(self.dataset, total - count, total, dtype)

    def unseen_rows(self, rows: int, batch_rows: int, ctx, plan) -> UnseenRows | None:
        """The held-out tail, on rank 0 (sae_dist.data.sources.base); its size was fixed when the stream
        was opened (sae_dist.defaults.heldout_rows_of), so `rows` is not read again here."""
        n = self.holdout_rows
        if not ctx.is_main or n == 0:
            return None
        # The tail's first row, by its place in the files: planted shards are the synthetic stream's
        # rows 0..total-1 in that order, so the evaluation finds their ground truth there.
        return UnseenRows(tail_batches(self.dataset, n, batch_rows),
                          f"the shards' held-out tail ({n:,} rows no batch drew)",
                          first_row=self.dataset.total_rows - n)

    def _gather(self, indices: Tensor, out: Tensor) -> None:
        files, counts = torch.unique_consecutive(torch.searchsorted(self._ends, indices, right=True),
                                                 return_counts=True)
        pos = 0
        for f, count in zip(files.tolist(), counts.tolist()):
            view, dst = self._views[f], out[pos:pos + count]
            local = indices[pos:pos + count] - self._starts[f]
            if view.dtype == out.dtype:
                torch.index_select(view, 0, local, out=dst)
            else:
                dst.copy_(view.index_select(0, local))
            pos += count

    # -- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with exactly the batches this stream would produce next:
        the position, and the settings that fix the order (checked on loading)."""
        return {"stream": "epochs", "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                "block_rows": self.block_rows, "buffer_rows": self.buffer_rows,
                "holdout_rows": self.holdout_rows, "total_rows": self.dataset.total_rows,
                "position": self._pos, "epoch": self.epoch, "rows_seen": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "buffer" in state:
            raise _shared(DataError(
                f"the checkpoint's data stream was written by an earlier sae-dist whose shuffle (a rolling "
                f"buffer) cannot be continued exactly by this version's exact epochs over "
                f"{self.dataset.directory}: start a new run"))
        # These fix which rows the position means; a different value would silently read other data.
        for key, mine in (("total_rows", self.dataset.total_rows), ("holdout_rows", self.holdout_rows),
                          ("world_size", self.world_size), ("rank", self.rank), ("seed", self.seed),
                          ("block_rows", self.block_rows), ("buffer_rows", self.buffer_rows)):
            if state.get(key) != mine:
                raise _shared(DataError(
                    f"the checkpoint's data stream was saved with {key}={state.get(key)}, but this run has "
                    f"{key}={mine} (data: {self.dataset.directory}); resume with the same data and "
                    f"settings, or start a new run"))
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise _shared(DataError(f"the checkpoint's data stream has no valid position ({position!r}); "
                                    f"the checkpoint is damaged: resume from an earlier one, or start a new run"))
        self._pos = position

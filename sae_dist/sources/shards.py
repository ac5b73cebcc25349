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
* an optional held-out tail (the last holdout_rows rows) is never trained on: an evaluation at the
  end of a run reads it with ShardStream.heldout_rows.

The directory's layout and its writers are in sae_dist.shard_format.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sae_dist.errors import DataError
from sae_dist.shard_format import FORMAT, MANIFEST, ST_DTYPES, SUFFIX, TENSOR, VERSION, dtype_name

log = logging.getLogger(__name__)

_MAX_HEADER = 100_000_000  # safetensors' own limit: a bigger claim means "not a safetensors file"
_REDO = "re-copy or regenerate it, or move it out of the directory"
_STALE = "the manifest is stale: regenerate the shards, or delete manifest.json to use the files as they are"


# ----------------------------------------------------------------------------------------------
# Opening and validating


@dataclass
class ShardDataset:
    """What open_shards found: the files in row order and their shapes. Holds no data."""

    directory: Path
    files: list[Path]
    rows: list[int]  # rows per file, same order as files
    d_in: int
    dtype: torch.dtype
    total_rows: int
    manifest: dict[str, Any]  # manifest.json as read; {} when the directory has none
    data_offsets: list[int] = field(default_factory=list)  # byte offset of each file's rows, for mapping


@dataclass(frozen=True)
class _Header:
    rows: int
    d_in: int
    dtype: torch.dtype
    data_start: int  # absolute byte offset of the activations in the file
    data_end: int


def open_shards(directory: str | os.PathLike, verify_checksums: bool = False) -> ShardDataset:
    """Validate a shard directory from the file headers (and manifest.json if present), reading no data.

    verify_checksums additionally reads every file and compares it with the manifest's sha256.
    """
    directory = Path(directory)
    if not directory.exists():
        raise DataError(f"shard directory {directory} does not exist; check the data path in the config, "
                        f"or write the shards there first")
    if not directory.is_dir():
        raise DataError(f"{directory} is not a directory; the shards source needs a directory of "
                        f"{SUFFIX} files")
    on_disk = sorted(p for p in directory.glob("*" + SUFFIX) if p.is_file())
    if not on_disk:
        raise DataError(f"{directory} holds no {SUFFIX} files (empty shard directory); point the config "
                        f"at the directory that holds the activation shards")
    manifest_path = directory / MANIFEST
    manifest = _read_manifest(manifest_path) if manifest_path.exists() else {}
    files = _listed_files(manifest_path, manifest, on_disk) if manifest else on_disk
    headers = [_read_header(path) for path in files]
    d_in, dtype = _common_shape(files, headers)
    rows = [h.rows for h in headers]
    if manifest:
        _check_manifest(manifest_path, manifest, files, headers)
    if sum(rows) == 0:
        raise DataError(f"{directory}: every {SUFFIX} file holds 0 rows; harvest some activations first")
    if verify_checksums:
        _verify_checksums(manifest_path, manifest, files)
    return ShardDataset(directory=directory, files=files, rows=rows, d_in=d_in, dtype=dtype,
                        total_rows=sum(rows), manifest=manifest,
                        data_offsets=[h.data_start for h in headers])


def _read_header(path: Path) -> _Header:
    """Parse the safetensors header ourselves (8-byte little-endian length + JSON): no data is read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise DataError(f"{path}: not a valid safetensors file (only {size} bytes, too short for "
                                f"a header); {_REDO}")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER or 8 + length > size:
                raise DataError(f"{path}: not a valid safetensors file, or truncated inside its header "
                                f"(it announces a {length}-byte header but the file has {size} bytes); {_REDO}")
            raw = f.read(length)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check that the file is readable") from e
    try:
        header = json.loads(raw)
    except ValueError as e:  # also covers bytes that are not UTF-8
        raise DataError(f"{path}: not a valid safetensors file (its header is not JSON: {e}); {_REDO}") from e
    if not isinstance(header, dict):
        raise DataError(f"{path}: not a valid safetensors file (its header is not a JSON object); {_REDO}")
    return _activations_entry(path, header, size, 8 + length)


def _activations_entry(path: Path, header: dict, size: int, data_base: int) -> _Header:
    entry = header.get(TENSOR)
    if entry is None:
        names = sorted(k for k in header if k != "__metadata__")
        raise DataError(f"{path}: no '{TENSOR}' tensor (it holds {names or 'no tensors'}); save the "
                        f"activations under the name '{TENSOR}'")
    shape = entry.get("shape") if isinstance(entry, dict) else None
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (_int_list(shape) and _int_list(offsets) and len(offsets) == 2):
        raise DataError(f"{path}: not a valid safetensors file (the '{TENSOR}' entry has no valid shape "
                        f"and data_offsets); {_REDO}")
    dtype = ST_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise DataError(f"{path}: '{TENSOR}' has unsupported dtype {entry.get('dtype')}; convert it to "
                        f"float32, float16 or bfloat16")
    if len(shape) != 2:
        raise DataError(f"{path}: '{TENSOR}' has shape {shape}, but it must be 2-D [rows, d_in]; save "
                        f"it as x.reshape(-1, d_in)")
    rows, d_in = shape
    if d_in == 0:
        raise DataError(f"{path}: '{TENSOR}' has d_in=0 (shape {shape}); regenerate the file")
    begin, end = offsets
    if begin < 0 or end - begin != rows * d_in * dtype.itemsize:
        raise DataError(f"{path}: not a valid safetensors file (data_offsets {offsets} do not match shape "
                        f"{shape} of {entry['dtype']}); {_REDO}")
    if data_base + end > size:
        raise DataError(f"{path}: truncated: its header says the data ends at byte {data_base + end} "
                        f"but the file has {size} bytes (an interrupted copy?); {_REDO}")
    return _Header(rows, d_in, dtype, data_base + begin, data_base + end)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                           for v in value)


def _common_shape(files: list[Path], headers: list[_Header]) -> tuple[int, torch.dtype]:
    first, h0 = files[0], headers[0]
    for path, h in zip(files[1:], headers[1:]):
        if h.d_in != h0.d_in:
            raise DataError(f"mixed d_in: {first} has d_in={h0.d_in} but {path} has d_in={h.d_in}; all "
                            f"shards must hold the same activation site, so move the odd files out")
        if h.dtype != h0.dtype:
            raise DataError(f"mixed dtypes: {first} is {dtype_name(h0.dtype)} but {path} is "
                            f"{dtype_name(h.dtype)}; convert the shards to one dtype")
    return h0.d_in, h0.dtype


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot be read as JSON ({e}); fix it, or delete it to derive everything "
                        f"from the shard headers") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a sae-dist shard manifest (no \"format\": \"{FORMAT}\"); delete or "
                        f"rename it to derive everything from the shard headers")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: manifest version {manifest.get('version')} is not supported (this "
                        f"sae-dist reads version {VERSION}); upgrade sae-dist or rewrite the shards")
    shards = manifest.get("shards")
    if not (isinstance(shards, list) and all(
            isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("rows"), int)
            for s in shards)):
        raise DataError(f"{path}: \"shards\" must be a list of {{\"file\", \"rows\", \"sha256\"}} entries; "
                        f"fix it, or delete manifest.json")
    return manifest


def _listed_files(manifest_path: Path, manifest: dict, on_disk: list[Path]) -> list[Path]:
    """The manifest's files in its order; each must exist, and no shard on disk may be left out."""
    directory = manifest_path.parent
    names = [s["file"] for s in manifest["shards"]]
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise DataError(f"{manifest_path}: shard file {name!r} is not a plain file name; the manifest "
                            f"may only list files in its own directory")
        if not (directory / name).is_file():
            raise DataError(f"{manifest_path} lists {name}, which is missing from {directory}; restore the "
                            f"file, or delete manifest.json to use the files present")
    if len(set(names)) != len(names):
        raise DataError(f"{manifest_path} lists a shard file twice; {_STALE}")
    unlisted = sorted({p.name for p in on_disk} - set(names))
    if unlisted:
        raise DataError(f"{directory / unlisted[0]} is not listed in {manifest_path} ({len(unlisted)} file(s) "
                        f"unlisted); move it out, or delete manifest.json to use every file present")
    return [directory / name for name in names]


def _check_manifest(path: Path, manifest: dict, files: list[Path], headers: list[_Header]) -> None:
    if manifest.get("d_in") != headers[0].d_in:
        raise DataError(f"{path} says d_in={manifest.get('d_in')} but {files[0]} holds d_in="
                        f"{headers[0].d_in}; {_STALE}")
    if manifest.get("dtype") != dtype_name(headers[0].dtype):
        raise DataError(f"{path} says dtype={manifest.get('dtype')} but {files[0]} holds "
                        f"{dtype_name(headers[0].dtype)}; {_STALE}")
    for entry, file, h in zip(manifest["shards"], files, headers):
        if entry["rows"] != h.rows:
            raise DataError(f"{path} says {file.name} has {entry['rows']} rows but the file holds {h.rows}; "
                            f"{_STALE}")
    total = sum(h.rows for h in headers)
    if manifest.get("total_rows") != total:
        raise DataError(f"{path} says total_rows={manifest.get('total_rows')} but the files hold {total}; "
                        f"{_STALE}")


def _verify_checksums(manifest_path: Path, manifest: dict, files: list[Path]) -> None:
    if not manifest:
        raise DataError(f"checksum verification asked for, but {manifest_path} does not exist; write the "
                        f"shards with write_shards, or turn verification off")
    for entry, path in zip(manifest["shards"], files):
        expected = entry.get("sha256")
        if not isinstance(expected, str):
            raise DataError(f"{manifest_path}: {path.name} has no sha256 to verify against; turn "
                            f"verification off, or rewrite the shards with write_shards")
        with open(path, "rb") as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if actual != expected:
            raise DataError(f"{path}: checksum mismatch (sha256 {actual[:16]}..., manifest says "
                            f"{expected[:16]}...); the file is corrupt or was replaced: {_REDO}")


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
                        f"opening? {_REDO}") from e
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
        """Rank's slice of each micro-batch of the next step (a sae_dist.balance.BatchPlan).

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

"""The shards format on disk: what a harvest (and make-planted, and tests) write and the `shards`
source reads (sae_dist.sources.shards). Its own module so that the writers need nothing of the
readers: sae_dist.harvest imports this, never sae_dist.sources.

Directory layout::

    shard_00000.safetensors  one tensor "activations" [rows, d_in], float32/float16/bfloat16
    shard_00001.safetensors  ...
    manifest.json            {"format": "sae-dist-shards", "version": 1, "d_in", "dtype",
                              "total_rows", "shards": [{"file", "rows", "sha256"}], + metadata}

The manifest is optional: researchers drop safetensors files in a folder, and then everything is
derived from the file headers (files in name order).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from sae_dist.errors import DataError

FORMAT = "sae-dist-shards"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR = "activations"
SUFFIX = ".safetensors"

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # safetensors' names
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
_RESERVED = {"format", "version", "d_in", "dtype", "total_rows", "shards"}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling used in manifest.json."""
    return str(dtype).removeprefix("torch.")


def write_shards(directory: str | os.PathLike, tensors: Iterable[Tensor],
                 metadata: dict[str, Any] | None = None) -> Path:
    """Write each [n, d_in] tensor as shard_NNNNN.safetensors, then manifest.json; returns the directory.

    Every file goes to a temporary name first and is renamed once complete (and synced), so a crash
    never leaves a half-written shard under a real name. The manifest is written last.
    """
    directory = Path(directory)
    metadata = dict(metadata or {})
    clash = sorted(_RESERVED & metadata.keys())
    if clash:
        raise ValueError(f"write_shards: metadata keys {clash} are reserved for the manifest itself")
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.glob("*" + SUFFIX)) or (directory / MANIFEST).exists():
        raise DataError(f"{directory} already holds shards; write to a new directory, or delete the old "
                        f"shards and manifest.json first")
    entries: list[dict[str, Any]] = []
    d_in: int | None = None
    dtype: torch.dtype | None = None
    for tensor in tensors:
        tensor = _checked_for_writing(tensor, len(entries), d_in, dtype)
        if tensor.shape[0] == 0:
            continue  # an empty chunk adds nothing; skipping it keeps shard files non-empty
        d_in, dtype = tensor.shape[1], tensor.dtype
        name = f"shard_{len(entries):05d}{SUFFIX}"
        sha = _write_safetensors(directory / name, tensor)
        entries.append({"file": name, "rows": int(tensor.shape[0]), "sha256": sha})
    if not entries:
        raise DataError(f"write_shards({directory}): no rows were given; nothing to write")
    write_manifest(directory, entries, d_in, dtype, metadata)
    return directory


def write_shard_file(path: Path, tensor: Tensor) -> dict[str, Any]:
    """One [rows, d_in] shard, written atomically; its manifest entry {"file", "rows", "sha256"}."""
    tensor = _checked_for_writing(tensor, 0, None, None)
    return {"file": path.name, "rows": int(tensor.shape[0]), "sha256": _write_safetensors(path, tensor)}


def write_manifest(directory: Path, entries: list[dict[str, Any]], d_in: int, dtype: torch.dtype,
                   metadata: dict[str, Any] | None = None) -> None:
    """manifest.json for these shard entries, written last and atomically (its presence marks a
    complete directory)."""
    metadata = dict(metadata or {})
    clash = sorted(_RESERVED & metadata.keys())
    if clash:
        raise ValueError(f"write_manifest: metadata keys {clash} are reserved for the manifest itself")
    manifest = {"format": FORMAT, "version": VERSION, "d_in": d_in, "dtype": dtype_name(dtype),
                "total_rows": sum(e["rows"] for e in entries), "shards": entries, **metadata}
    _write_atomically(directory / MANIFEST, [json.dumps(manifest, indent=1).encode() + b"\n"])
    _fsync_directory(directory)


def _checked_for_writing(tensor: Tensor, index: int, d_in: int | None, dtype: torch.dtype | None) -> Tensor:
    if tensor.dim() != 2:
        raise DataError(f"write_shards: tensor {index} has shape {list(tensor.shape)}, but shards hold "
                        f"2-D [rows, d_in] activations; reshape it with .reshape(-1, d_in)")
    if tensor.dtype not in ST_NAMES:
        raise DataError(f"write_shards: tensor {index} has dtype {tensor.dtype}; convert it to float32, "
                        f"float16 or bfloat16")
    if d_in is not None and tensor.shape[1] != d_in:
        raise DataError(f"write_shards: tensor {index} has d_in={tensor.shape[1]} but earlier tensors "
                        f"have d_in={d_in}; all shards must hold the same activation site")
    if dtype is not None and tensor.dtype != dtype:
        raise DataError(f"write_shards: tensor {index} has dtype {tensor.dtype} but earlier tensors have "
                        f"{dtype}; convert them to one dtype")
    return tensor.detach().cpu().contiguous()


def _write_safetensors(path: Path, tensor: Tensor) -> str:
    """Write a one-tensor safetensors file by hand (hashing while writing: no second pass); return its sha256."""
    nbytes = tensor.numel() * tensor.element_size()
    header = json.dumps({TENSOR: {"dtype": ST_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                  "data_offsets": [0, nbytes]}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # pad like safetensors does: the data then starts 8-aligned
    data = tensor.view(torch.uint8).numpy() if nbytes else b""  # little-endian, as safetensors wants
    chunks = [struct.pack("<Q", len(header)), header, memoryview(data)]
    return _write_atomically(path, chunks)


def _write_atomically(path: Path, chunks: list[bytes | memoryview]) -> str:
    """Write chunks to a hidden temporary name, fsync, rename over `path`; return the sha256 of the bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    # Makes the renames themselves durable; not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

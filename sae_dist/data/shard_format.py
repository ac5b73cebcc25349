"""The shards format on disk: what a harvest (and make-planted, and tests) write and the `shards`
source reads (sae_dist.data.sources.shards). Its own module so that the writers need nothing of the
readers: sae_dist.data.harvest imports this, never sae_dist.data.sources.

Directory layout::

    shard_00000.safetensors  one tensor "activations" [rows, d_in], float32/float16/bfloat16
    shard_00001.safetensors  ...
    manifest.json            {"format": "sae-dist-shards", "version": 1, "d_in", "dtype",
                              "total_rows", "shards": [{"file", "rows", "sha256"}], + metadata}

The manifest is optional: researchers drop safetensors files in a folder, and then everything is
derived from the file headers (files in name order). read_layout validates a directory from the
headers alone. Nothing here imports torch at module level: the app reads a directory's d_in
without it, and a writer is handed tensors (so torch is already loaded when one runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from sae_dist.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

FORMAT = "sae-dist-shards"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR = "activations"
SUFFIX = ".safetensors"

ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' names -> ours
ST_NAMES = {name: st for st, name in ST_DTYPES.items()}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per element
_RESERVED = {"format", "version", "d_in", "dtype", "total_rows", "shards"}
_MAX_HEADER = 100_000_000  # safetensors' own limit: a bigger claim means "not a safetensors file"
REDO = "re-copy or regenerate it, or move it out of the directory"
_STALE = "the manifest is stale: regenerate the shards, or delete manifest.json to use the files as they are"


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
    if dtype_name(tensor.dtype) not in ST_NAMES:
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
    import torch  # already loaded: the caller holds a tensor

    nbytes = tensor.numel() * tensor.element_size()
    header = json.dumps({TENSOR: {"dtype": ST_NAMES[dtype_name(tensor.dtype)], "shape": list(tensor.shape),
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


# ----------------------------------------------------------------------------------------------
# Opening and validating


@dataclass
class ShardLayout:
    """What read_layout found: the files in row order and their shapes. Holds no data, needs no
    torch (the Train page reads d_in with it); sae_dist.data.sources.shards.open_shards adds the dtype
    as a torch.dtype."""

    directory: Path
    files: list[Path]
    rows: list[int]  # rows per file, same order as files
    d_in: int
    dtype_name: str  # "float32", "float16" or "bfloat16": manifest.json's spelling
    total_rows: int
    manifest: dict[str, Any]  # manifest.json as read; {} when the directory has none
    data_offsets: list[int] = field(default_factory=list)  # byte offset of each file's rows, for mapping


@dataclass(frozen=True)
class _Header:
    rows: int
    d_in: int
    dtype: str  # manifest.json's spelling
    data_start: int  # absolute byte offset of the activations in the file
    data_end: int


def read_layout(directory: str | os.PathLike, verify_checksums: bool = False) -> ShardLayout:
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
    return ShardLayout(directory=directory, files=files, rows=rows, d_in=d_in, dtype_name=dtype,
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
                                f"a header); {REDO}")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER or 8 + length > size:
                raise DataError(f"{path}: not a valid safetensors file, or truncated inside its header "
                                f"(it announces a {length}-byte header but the file has {size} bytes); {REDO}")
            raw = f.read(length)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check that the file is readable") from e
    try:
        header = json.loads(raw)
    except ValueError as e:  # also covers bytes that are not UTF-8
        raise DataError(f"{path}: not a valid safetensors file (its header is not JSON: {e}); {REDO}") from e
    if not isinstance(header, dict):
        raise DataError(f"{path}: not a valid safetensors file (its header is not a JSON object); {REDO}")
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
                        f"and data_offsets); {REDO}")
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
    if begin < 0 or end - begin != rows * d_in * ITEMSIZE[dtype]:
        raise DataError(f"{path}: not a valid safetensors file (data_offsets {offsets} do not match shape "
                        f"{shape} of {entry['dtype']}); {REDO}")
    if data_base + end > size:
        raise DataError(f"{path}: truncated: its header says the data ends at byte {data_base + end} "
                        f"but the file has {size} bytes (an interrupted copy?); {REDO}")
    return _Header(rows, d_in, dtype, data_base + begin, data_base + end)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                           for v in value)


def _common_shape(files: list[Path], headers: list[_Header]) -> tuple[int, str]:
    first, h0 = files[0], headers[0]
    for path, h in zip(files[1:], headers[1:]):
        if h.d_in != h0.d_in:
            raise DataError(f"mixed d_in: {first} has d_in={h0.d_in} but {path} has d_in={h.d_in}; all "
                            f"shards must hold the same activation site, so move the odd files out")
        if h.dtype != h0.dtype:
            raise DataError(f"mixed dtypes: {first} is {h0.dtype} but {path} is "
                            f"{h.dtype}; convert the shards to one dtype")
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
    if manifest.get("dtype") != headers[0].dtype:
        raise DataError(f"{path} says dtype={manifest.get('dtype')} but {files[0]} holds "
                        f"{headers[0].dtype}; {_STALE}")
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
                            f"{expected[:16]}...); the file is corrupt or was replaced: {REDO}")


# ---- a transcoder's paired rows [input | target] (sae_dist.data.sources.paired) ----

PAIR_KEY = "pair"  # manifest.json: [input site, output site]


def shard_pair(manifest: dict[str, Any]) -> tuple[str, str] | None:
    pair = manifest.get(PAIR_KEY)
    return (str(pair[0]), str(pair[1])) if isinstance(pair, list) and len(pair) == 2 else None


def input_width(layout, transcode: tuple[str, str] | None) -> int:
    """The SAE's d_in from a shard set's row width, once the set suits the config: a transcoder
    reads shards that pair its two sites, an SAE reads one site's."""
    pair = shard_pair(layout.manifest)
    where = layout.directory
    if transcode is None:
        if pair is not None:
            raise ConfigError("transcode", f"{where} holds pairs ({pair[0]}:{pair[1]}) for a transcoder; add "
                                           f"--transcode {pair[0]}:{pair[1]} to train one")
        return layout.d_in
    if pair is None:
        raise ConfigError("transcode", f"{where} holds one site's rows, not pairs: harvest with --transcode "
                                       f"{':'.join(transcode)}, or join an input set and a target set with "
                                       f"pair-shards")
    if pair != tuple(transcode):
        raise ConfigError("transcode", f"{where} pairs {pair[0]}:{pair[1]}, not {':'.join(transcode)}")
    if layout.d_in % 2:
        raise DataError(f"{where}: paired rows are [input | target] of equal widths, but these are {layout.d_in} wide")
    return layout.d_in // 2

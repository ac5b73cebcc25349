"""The shards source on real files: round trips, rank splits, determinism, resume, and every DataError."""

from __future__ import annotations

import io
import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sae_dist.data.shard_format import write_shards
from sae_dist.data.sources.shards import ShardStream, open_shards
from sae_dist.errors import DataError


def indexed_rows(start: int, count: int, d_in: int = 4) -> torch.Tensor:
    """Row i is filled with the value i, so a batch tells exactly which rows it holds."""
    return torch.arange(start, start + count, dtype=torch.float32).unsqueeze(1).expand(count, d_in).contiguous()


def indexed_shards(directory: Path, sizes: list[int], d_in: int = 4) -> Path:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return write_shards(directory, [indexed_rows(s, n, d_in) for s, n in zip(starts, sizes)])


def row_ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def batches(stream: ShardStream, count: int) -> list[torch.Tensor]:
    return [stream.next_batch() for _ in range(count)]


# -- writing and reading --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, 8, generator=gen).to(dtype) for n in (70, 0, 50, 80)]
    meta = {"model": "gpt2", "layer": 6, "site": "resid_post", "context_length": 128}
    write_shards(tmp_path / "s", iter(tensors), meta)

    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == ["manifest.json", "shard_00000.safetensors", "shard_00001.safetensors",
                     "shard_00002.safetensors"]  # the empty tensor is skipped, no temp files left
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["format"] == "sae-dist-shards" and manifest["version"] == 1
    assert manifest["d_in"] == 8 and manifest["total_rows"] == 200
    assert manifest["dtype"] == str(dtype).removeprefix("torch.")
    assert [s["rows"] for s in manifest["shards"]] == [70, 50, 80]
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert {k: manifest[k] for k in meta} == meta
    # The files are ordinary safetensors.
    assert torch.equal(load_file(tmp_path / "s" / "shard_00001.safetensors")["activations"], tensors[2])

    ds = open_shards(tmp_path / "s", verify_checksums=True)
    assert (ds.rows, ds.d_in, ds.dtype, ds.total_rows) == ([70, 50, 80], 8, dtype, 200)
    assert ds.manifest["model"] == "gpt2"

    stored = torch.cat(tensors)
    stream = ShardStream(ds, rank=0, world_size=1, batch_size=32, seed=1, buffer_rows=64, block_rows=16)
    for _ in range(10):
        native = stream.next_batch(dtype=dtype)
        assert native.shape == (32, 8) and native.dtype == dtype
        # Every row of the batch is one of the stored rows, bit for bit.
        match = (native.unsqueeze(1) == stored.unsqueeze(0)).all(-1)
        assert match.any(1).all()
        as_f32 = stream.next_batch()
        assert as_f32.dtype == torch.float32
        assert (as_f32.unsqueeze(1) == stored.float().unsqueeze(0)).all(-1).any(1).all()
    assert stream.rows_seen == 20 * 32


def test_open_without_manifest_derives_from_headers(tmp_path: Path) -> None:
    save_file({"activations": indexed_rows(0, 30)}, tmp_path / "b.safetensors")
    save_file({"activations": indexed_rows(30, 20), "other": torch.zeros(2)}, tmp_path / "a.safetensors")
    (tmp_path / "notes.txt").write_text("not a shard")
    ds = open_shards(tmp_path)
    assert [p.name for p in ds.files] == ["a.safetensors", "b.safetensors"]
    assert (ds.rows, ds.d_in, ds.total_rows, ds.manifest) == ([20, 30], 4, 50, {})
    seen = set()
    stream = ShardStream(ds, 0, 1, batch_size=10, seed=0, buffer_rows=10, block_rows=10)
    for batch in batches(stream, 5):
        seen.update(row_ids(batch))
    assert seen == set(range(50))


def test_unaligned_data_falls_back_to_reading(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A hand-made file whose header is not padded: the float32 data starts at an odd byte offset.
    data = indexed_rows(0, 16)
    header = json.dumps({"activations": {"dtype": "F32", "shape": [16, 4], "data_offsets": [0, 256]}}).encode()
    header += b" " * ((1 - len(header)) % 8)  # 8 + len(header) is odd
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data.numpy().tobytes())
    ds = open_shards(tmp_path)
    with caplog.at_level(logging.WARNING):
        stream = ShardStream(ds, 0, 1, batch_size=16, seed=0)
    assert "not aligned" in caplog.text
    assert sorted(row_ids(stream.next_batch())) == list(range(16))


def test_write_refuses_a_directory_with_shards(tmp_path: Path) -> None:
    write_shards(tmp_path, [indexed_rows(0, 10)])
    with pytest.raises(DataError, match="already holds shards"):
        write_shards(tmp_path, [indexed_rows(0, 10)])


# -- ranks, shuffling, resume ---------------------------------------------------------------------


def test_two_ranks_read_disjoint_parts_covering_every_row(tmp_path: Path) -> None:
    ds = open_shards(indexed_shards(tmp_path, [300, 450, 250]))
    # Blocks as big as the batch and the buffer: one epoch is exactly part/batch batches.
    parts = []
    for rank in (0, 1):
        stream = ShardStream(ds, rank, 2, batch_size=50, seed=3, buffer_rows=50, block_rows=50)
        rows = [r for b in batches(stream, 10) for r in row_ids(b)]
        assert len(rows) == len(set(rows)) == 500 and stream.epoch == 0
        parts.append(set(rows))
    assert parts[0] == set(range(500)) and parts[1] == set(range(500, 1000))


def test_ranks_stay_in_their_part_and_cover_it_evenly(tmp_path: Path) -> None:
    ds = open_shards(indexed_shards(tmp_path, [333, 200, 468]))  # 1001 rows: parts of 500 and 501
    bounds = [(0, 500), (500, 1001)]
    for rank, (lo, hi) in enumerate(bounds):
        stream = ShardStream(ds, rank, 2, batch_size=32, seed=0, buffer_rows=200, block_rows=64)
        counts = torch.zeros(1001, dtype=torch.long)
        for batch in batches(stream, 60):  # 1920 rows: 3 whole epochs and part of a fourth
            counts += torch.bincount(torch.tensor(row_ids(batch)), minlength=1001)
        assert counts[:lo].sum() == 0 and counts[hi:].sum() == 0
        whole, rest = divmod(60 * 32, hi - lo)
        # Exact epochs: every row 3 times, and the fourth epoch's first `rest` rows once more.
        assert set(counts[lo:hi].tolist()) == {whole, whole + 1}
        assert int((counts[lo:hi] == whole + 1).sum()) == rest
        assert stream.epoch == whole and stream.rows_seen == 60 * 32


def test_same_seed_same_batches_other_seed_other_batches(tmp_path: Path) -> None:
    ds = open_shards(indexed_shards(tmp_path, [400, 400]))

    def run(seed: int) -> list[torch.Tensor]:
        return batches(ShardStream(ds, 1, 2, batch_size=16, seed=seed, buffer_rows=100, block_rows=32), 30)

    first, again, other = run(7), run(7), run(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    # Shuffled: the rows do not come in file order.
    assert row_ids(first[0]) != sorted(range(400, 416))


@pytest.mark.parametrize("done", [3, 9, 10, 11])
def test_resume_continues_with_the_same_batches(tmp_path: Path, done: int) -> None:
    ds = open_shards(indexed_shards(tmp_path, [130, 190]))
    # 320 rows, 16 per batch: epochs roll over around batch 10, inside the compared window.
    def make() -> ShardStream:
        return ShardStream(ds, 0, 1, batch_size=16, seed=5, buffer_rows=80, block_rows=24)
    a = make()
    batches(a, done)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)  # through a checkpoint, as the trainer stores it
    epoch_at_save = a.epoch
    b = make()
    b.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    assert (b.epoch, b.rows_seen) == (epoch_at_save, done * 16)
    for x, y in zip(batches(a, 25), batches(b, 25)):
        assert torch.equal(x, y)
    assert a.epoch > epoch_at_save  # the window crossed an epoch boundary


def test_resume_refuses_another_rank_or_data(tmp_path: Path) -> None:
    ds = open_shards(indexed_shards(tmp_path / "a", [100]))
    state = ShardStream(ds, 0, 2, batch_size=8, seed=0).state_dict()
    with pytest.raises(DataError, match="rank=0, but this run has rank=1"):
        ShardStream(ds, 1, 2, batch_size=8, seed=0).load_state_dict(state)
    other = open_shards(indexed_shards(tmp_path / "b", [120]))
    with pytest.raises(DataError, match="total_rows=100, but this run has total_rows=120"):
        ShardStream(other, 0, 2, batch_size=8, seed=0).load_state_dict(state)


# -- errors ---------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope does not exist"):
        open_shards(tmp_path / "nope")


def test_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is not a directory"):
        open_shards(tmp_path / "file")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=r"holds no \.safetensors files"):
        open_shards(tmp_path)


def test_corrupt_header(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"activations": indexed_rows(0, 10)}, path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"@@@@"  # break the JSON
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"bad\.safetensors: not a valid safetensors file \(its header is not JSON"):
        open_shards(tmp_path)


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    (tmp_path / "text.safetensors").write_text("hello, this is plainly not a safetensors file")
    with pytest.raises(DataError, match=r"text\.safetensors: not a valid safetensors file.*announces a"):
        open_shards(tmp_path)


def test_truncated_file(tmp_path: Path) -> None:
    write_shards(tmp_path, [indexed_rows(0, 10), indexed_rows(10, 10)])
    path = tmp_path / "shard_00001.safetensors"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"shard_00001\.safetensors: truncated: .* ends at byte \d+ but the file has"):
        open_shards(tmp_path)


def test_missing_activations_tensor(tmp_path: Path) -> None:
    save_file({"acts": indexed_rows(0, 10)}, tmp_path / "x.safetensors")
    with pytest.raises(DataError, match=r"x\.safetensors: no 'activations' tensor \(it holds \['acts'\]\)"):
        open_shards(tmp_path)


def test_not_2d(tmp_path: Path) -> None:
    save_file({"activations": torch.zeros(2, 5, 4)}, tmp_path / "x.safetensors")
    with pytest.raises(DataError, match=r"x\.safetensors: 'activations' has shape \[2, 5, 4\], but it must be 2-D"):
        open_shards(tmp_path)


def test_unsupported_dtype(tmp_path: Path) -> None:
    save_file({"activations": torch.zeros(5, 4, dtype=torch.float64)}, tmp_path / "x.safetensors")
    with pytest.raises(DataError, match=r"x\.safetensors: 'activations' has unsupported dtype F64"):
        open_shards(tmp_path)


def test_mixed_d_in(tmp_path: Path) -> None:
    save_file({"activations": torch.zeros(5, 4)}, tmp_path / "a.safetensors")
    save_file({"activations": torch.zeros(5, 6)}, tmp_path / "b.safetensors")
    with pytest.raises(DataError, match=r"mixed d_in: .*a\.safetensors has d_in=4 but .*b\.safetensors has d_in=6"):
        open_shards(tmp_path)


def _edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_manifest_disagrees_on_d_in(tmp_path: Path) -> None:
    indexed_shards(tmp_path, [10, 10])
    _edit_manifest(tmp_path, d_in=5)
    with pytest.raises(DataError, match=r"manifest\.json says d_in=5 but .*shard_00000\.safetensors holds d_in=4"):
        open_shards(tmp_path)


def test_manifest_disagrees_on_rows(tmp_path: Path) -> None:
    indexed_shards(tmp_path, [10, 10])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][1]["rows"] = 11
    _edit_manifest(tmp_path, shards=manifest["shards"])
    with pytest.raises(DataError, match=r"says shard_00001\.safetensors has 11 rows but the file holds 10"):
        open_shards(tmp_path)


def test_manifest_lists_a_missing_file(tmp_path: Path) -> None:
    indexed_shards(tmp_path, [10, 10])
    (tmp_path / "shard_00001.safetensors").unlink()
    with pytest.raises(DataError, match=r"lists shard_00001\.safetensors, which is missing"):
        open_shards(tmp_path)


def test_file_not_in_manifest(tmp_path: Path) -> None:
    indexed_shards(tmp_path, [10, 10])
    save_file({"activations": indexed_rows(0, 10)}, tmp_path / "extra.safetensors")
    with pytest.raises(DataError, match=r"extra\.safetensors is not listed in .*manifest\.json"):
        open_shards(tmp_path)


def test_checksum_mismatch(tmp_path: Path) -> None:
    indexed_shards(tmp_path, [10, 10])
    path = tmp_path / "shard_00000.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # still a valid file, different data
    path.write_bytes(bytes(raw))
    open_shards(tmp_path)  # without verification the header is all that is checked
    with pytest.raises(DataError, match=r"shard_00000\.safetensors: checksum mismatch"):
        open_shards(tmp_path, verify_checksums=True)


def test_too_few_rows_for_the_batch(tmp_path: Path) -> None:
    ds = open_shards(indexed_shards(tmp_path, [100]))
    ShardStream(ds, 1, 2, batch_size=50, seed=0)
    with pytest.raises(DataError, match=r"has 100 rows, so rank 0 of 4 gets 25, fewer than one batch of 32: "
                                        r"4 devices x batch 32 needs at least 128 rows"):
        ShardStream(ds, 0, 4, batch_size=32, seed=0)

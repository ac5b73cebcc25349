"""Exact epochs of the shards stream on real files: every row once a pass, seeded orders, resume
at any position, ranks' slices, the held-out tail, and the errors of bad settings or old states."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from sae_dist.data.shard_format import write_shards
from sae_dist.data.sources.shards import ShardStream, open_shards, read_rows
from sae_dist.errors import DataError
from sae_dist.train.balance import BatchPlan

ROWS = 301  # a prime: no batch or block size used here divides it
SIZES = [97, 204]  # two files, so reads cross a file boundary


def indexed_rows(start: int, count: int, d_in: int = 4) -> torch.Tensor:
    """Row i is filled with the value i, so a batch tells exactly which rows it holds."""
    return torch.arange(start, start + count, dtype=torch.float32).unsqueeze(1).expand(count, d_in).contiguous()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("epochs") / "acts"
    write_shards(directory, [indexed_rows(0, SIZES[0]), indexed_rows(SIZES[0], SIZES[1])])
    return open_shards(directory)


def ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def stream_order(ds, count: int, **settings) -> list[int]:
    """The stream's first `count` rows in its own order (batches of 1 row are never re-sorted)."""
    stream = ShardStream(ds, 0, 1, batch_size=1, **settings)
    return [ids(stream.next_batch())[0] for _ in range(count)]


def epochs_of(order: list[int], rows: int) -> list[list[int]]:
    return [order[i:i + rows] for i in range(0, len(order), rows)]


# -- exact epochs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows, buffer_rows", [(7, 20), (30, 100), (64, 64), (16, 1000), (500, 65536)])
def test_every_row_exactly_once_an_epoch(dataset, block_rows: int, buffer_rows: int) -> None:
    settings = dict(seed=3, block_rows=block_rows, buffer_rows=buffer_rows)
    order = stream_order(dataset, 3 * ROWS, **settings)
    for epoch in epochs_of(order, ROWS):
        assert sorted(epoch) == list(range(ROWS))
    # Batches are consecutive slices of that order (each sorted for reading), straddling epochs too.
    stream = ShardStream(dataset, 0, 1, batch_size=37, **settings)
    for j in range(3 * ROWS // 37):
        assert ids(stream.next_batch()) == sorted(order[37 * j:37 * (j + 1)])
        assert stream.epoch == (37 * (j + 1) - 1) // ROWS and stream.rows_seen == 37 * (j + 1)


def test_epochs_differ_and_the_seed_fixes_the_order(dataset) -> None:
    first = epochs_of(stream_order(dataset, 2 * ROWS, seed=1, block_rows=10, buffer_rows=40), ROWS)
    again = epochs_of(stream_order(dataset, 2 * ROWS, seed=1, block_rows=10, buffer_rows=40), ROWS)
    other = epochs_of(stream_order(dataset, 2 * ROWS, seed=2, block_rows=10, buffer_rows=40), ROWS)
    assert first == again
    assert first[0] != first[1]  # a new permutation each epoch
    assert first[0] != other[0] and first[1] != other[1]
    assert first[0] != list(range(ROWS))  # shuffled, not file order


def test_reads_stay_within_a_window_of_blocks(tmp_path: Path) -> None:
    ds = open_shards(write_shards(tmp_path / "acts", [indexed_rows(0, 300)]))
    # 30 blocks of 10 rows, windows of 4 blocks (40 rows): a window's rows are 4 whole blocks.
    order = stream_order(ds, 300, seed=0, block_rows=10, buffer_rows=45)
    for start in range(0, 300, 40):
        window = order[start:start + 40]
        blocks = {row // 10 for row in window}
        assert len(blocks) == len(window) // 10
        assert sorted(window) == sorted(r for b in blocks for r in range(10 * b, 10 * b + 10))
    assert any(order[s:s + 10] != sorted(order[s:s + 10]) for s in range(0, 300, 10))  # shuffled within


def test_a_new_batch_size_goes_on_with_the_same_order(dataset) -> None:
    order = stream_order(dataset, 2 * ROWS, seed=4, block_rows=16, buffer_rows=64)
    stream = ShardStream(dataset, 0, 1, batch_size=16, seed=4, block_rows=16, buffer_rows=64)
    slices = [(16 * j, 16 * j + 16) for j in range(5)] + [(80 + 48 * j, 128 + 48 * j) for j in range(10)]
    for j, (lo, hi) in enumerate(slices):
        if j == 5:
            stream.use_global_batch(48)  # as a run resumed with another global batch does
        assert ids(stream.next_batch()) == sorted(order[lo:hi])


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("done", [0, 5, 18, 19, 37])  # mid-epoch, just before / after a boundary, epoch 2
def test_resume_gives_the_same_next_batches(dataset, done: int) -> None:
    def make() -> ShardStream:
        return ShardStream(dataset, 0, 1, batch_size=16, seed=5, block_rows=24, buffer_rows=80)
    a = make()
    for _ in range(done):
        a.next_batch()
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)  # through a checkpoint, as the trainer stores it
    b = make()
    b.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    assert (b.epoch, b.rows_seen) == (a.epoch, done * 16)
    for _ in range(25):  # 400 rows: past at least one more epoch boundary
        assert torch.equal(a.next_batch(), b.next_batch())


# -- ranks and shares ------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [BatchPlan(48, 2, (10, 14)), BatchPlan(48, 2, (5, 11, 8)),
                                  BatchPlan(48, 1, (31, 17))])
def test_ranks_slices_make_the_one_rank_batch(dataset, plan: BatchPlan) -> None:
    def make() -> ShardStream:
        return ShardStream(dataset, 0, 1, batch_size=48, seed=6, block_rows=16, buffer_rows=64)
    whole, ranks = make(), [make() for _ in plan.shares]
    for _ in range(14):  # 672 rows: more than two epochs
        expected = ids(whole.next_batch())
        got = [r for rank, stream in enumerate(ranks) for x in stream.next_batches(plan, rank) for r in ids(x)]
        for rank, stream in enumerate(ranks):
            assert stream.rows_seen == whole.rows_seen
        assert sorted(got) == expected


# -- the held-out tail -----------------------------------------------------------------------------


def test_holdout_rows_are_never_trained_on_and_read_back(dataset) -> None:
    train = ROWS - 41
    order = stream_order(dataset, 3 * train, seed=7, block_rows=16, buffer_rows=64, holdout_rows=41)
    for epoch in epochs_of(order, train):
        assert sorted(epoch) == list(range(train))
    stream = ShardStream(dataset, 0, 1, batch_size=32, seed=7, holdout_rows=41)
    assert all(max(ids(stream.next_batch())) < train for _ in range(30))
    held = stream.heldout_rows()
    assert held.shape == (41, 4) and held.dtype == torch.float32 and ids(held) == list(range(train, ROWS))
    assert ids(stream.heldout_rows(10)) == list(range(ROWS - 10, ROWS))  # the data set's last rows
    assert stream.heldout_rows(1000).shape == (41, 4)
    assert ShardStream(dataset, 0, 1, batch_size=32, seed=7).heldout_rows().shape == (0, 4)
    # Read across the file boundary, in another dtype.
    rows = read_rows(dataset, 90, 110, torch.float16)
    assert rows.dtype == torch.float16 and ids(rows) == list(range(90, 110))


def test_ranks_split_only_the_training_rows(dataset) -> None:
    train, seen = ROWS - 51, []
    for rank in (0, 1):
        stream = ShardStream(dataset, rank, 2, batch_size=25, seed=0, block_rows=8, buffer_rows=32, holdout_rows=51)
        rows = [r for _ in range(5) for r in ids(stream.next_batch())]  # one epoch of the 125-row part
        assert sorted(rows) == list(range(rank * 125, rank * 125 + 125))
        seen += rows
    assert sorted(seen) == list(range(train))


# -- errors -----------------------------------------------------------------------------------------


def test_a_holdout_that_leaves_too_few_rows(dataset) -> None:
    with pytest.raises(DataError, match=r"has 301 rows; holding out the last 290 for evaluation leaves 11 "
                                        r"to train on, fewer than one batch of 16; hold out fewer rows"):
        ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=290)
    with pytest.raises(DataError, match=r"holding out 301 of them for evaluation leaves none to train on"):
        ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=301)
    with pytest.raises(ValueError, match="holdout_rows must be 0 or more"):
        ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=-1)
    stream = ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=200)
    with pytest.raises(DataError, match=r"leaves 101 to train on, fewer than one batch of 128"):
        stream.use_global_batch(128)


def test_an_old_buffer_state_gives_one_clear_error(dataset) -> None:
    # What the rolling-buffer stream saved (one stream on every rank, and the older per-rank one).
    old = {"rank": 0, "world_size": 1, "seed": 0, "block_rows": 2048, "total_rows": ROWS, "epoch": 0,
           "block_pos": 1, "buffer": torch.arange(100, 301), "generator": torch.Generator().get_state(),
           "rows_seen": 100}
    for state in (old, {**old, "world_size": 2, "buffer": torch.arange(50, 150)}):
        with pytest.raises(DataError, match=r"written by an earlier sae-dist whose shuffle .* cannot be "
                                            r"continued exactly .*: start a new run") as caught:
            ShardStream(dataset, 0, 1, batch_size=16, seed=0).load_state_dict(state)
        assert caught.value.shared  # every rank loads the same state: rank 0 alone reports it


def test_resume_refuses_other_settings(dataset) -> None:
    state = ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=41).state_dict()
    cases = [(dict(holdout_rows=0), "holdout_rows=41, but this run has holdout_rows=0"),
             (dict(holdout_rows=41, buffer_rows=1024), "buffer_rows=65536, but this run has buffer_rows=1024"),
             (dict(holdout_rows=41, block_rows=512), "block_rows=2048, but this run has block_rows=512"),
             (dict(holdout_rows=41, seed=1), "seed=0, but this run has seed=1")]
    for settings, words in cases:
        with pytest.raises(DataError, match=words):
            ShardStream(dataset, 0, 1, batch_size=16, **{"seed": 0, **settings}).load_state_dict(state)
    with pytest.raises(DataError, match="no valid position"):
        ShardStream(dataset, 0, 1, batch_size=16, seed=0, holdout_rows=41).load_state_dict({**state, "position": -3})

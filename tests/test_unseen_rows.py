"""Each source's rows a run never trained on (ActivationSource.unseen_rows), the rows the end-of-run
evaluation reads: the same rows the evaluation read before the sources said which (the synthetic
stream's samples after its position; the shards' tail as sae_dist.evaluate reads a shard set)."""

from __future__ import annotations

import torch

from sae_dist.data.shard_format import write_shards
from sae_dist.data.sources.shards import ShardStream, open_shards
from sae_dist.data.sources.synthetic import SyntheticSource
from sae_dist.distributed import DistContext
from sae_dist.evaluate import heldout_rows
from sae_dist.train.balance import BatchPlan

CPU = torch.device("cpu")
MAIN, OTHER = DistContext(0, 2, 0, CPU, "none"), DistContext(1, 2, 1, CPU, "none")


def test_the_synthetic_stream_gives_its_samples_after_the_runs_last():
    src = SyntheticSource(d_in=8, n_features=16, active=2.0, power_law=0.5, noise=0.01, seed=3, rank=0,
                          world_size=1, batch_size=32)
    plan = BatchPlan(32, 1, (32,))
    for _ in range(3):
        src.next_batches(plan, 0)
    unseen = src.unseen_rows(150, 64, MAIN, plan)
    batches = list(unseen.batches)
    assert [len(b) for b in batches] == [64, 64, 22]
    assert torch.equal(torch.cat(batches), src.samples(96, 150))
    assert unseen.where == "150 synthetic rows after the run's last sample"
    assert src.unseen_rows(150, 64, OTHER, plan) is None


def test_shards_give_their_held_out_tail_and_nothing_without_one(tmp_path):
    directory = write_shards(tmp_path / "acts", [torch.randn(70, 4), torch.randn(50, 4)])
    stream = ShardStream(open_shards(directory), 0, 1, batch_size=16, seed=1, holdout_rows=60)
    unseen = stream.unseen_rows(1000, 25, MAIN, None)  # the tail's size was fixed at opening
    batches = list(unseen.batches)
    assert max(len(b) for b in batches) <= 25 and all(b.dtype == torch.float32 for b in batches)
    assert torch.equal(torch.cat(batches), heldout_rows(directory, 60))
    assert unseen.where == "the shards' held-out tail (60 rows no batch drew)"
    assert stream.unseen_rows(1000, 25, OTHER, None) is None
    assert ShardStream(open_shards(directory), 0, 1, batch_size=16, seed=1).unseen_rows(1000, 25, MAIN, None) is None

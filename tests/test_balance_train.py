"""Unequal shares, rebalancing and losing a rank, for real: torchrun-launched gloo ranks on CPU."""

from __future__ import annotations

import json
import re
import signal

import pytest
import torch

from conftest import LENGTH_FREE_SCHEDULE, main_here, run_cli
from sae_dist.contract import KILL_RANK_AT_ENV, SLOW_RANKS_ENV
from sae_dist.data.shard_format import write_shards
from sae_dist.train.balance import BalanceState
from sae_dist.train.checkpoint import STATE, latest_checkpoint
from sae_dist.train.survive import DEVICE_ERROR_EXIT, Failure, device_ids, lost_ranks, survivors_env
from test_train import REFERENCE, SMALL, final_weights, ok, one_rank_reference, rel_diff, shares_in

__all__ = ["one_rank_reference", "shares_in"]  # the session's 1-rank reference; shares_in for test_harvest


@pytest.mark.slow
def test_unequal_shares_give_the_whole_batch_result(tmp_path, one_rank_reference):
    """balance = speed on a rank slowed 4x: unequal shares from the start, and the weights of 1 rank
    with the whole batch (the gradient average is weighted by each rank's samples). (Memory balance
    on virtual devices: tests/test_train.py::test_two_ranks_match_one_rank_and_are_recorded.)"""
    out = ok(run_cli("train", *REFERENCE, "--devices", "cpu:2", "--batch-size", "128", "--balance", "speed",
                     "--out-dir", str(tmp_path / "speed"), env={SLOW_RANKS_ENV: "1:4"}))
    (first, micro_steps), = shares_in(out.stdout)
    # The shares follow the speeds measured here and printed (rank 1 computes 4x slower, but on a
    # machine crowded by other processes a measurement can still put it ahead: the test holds the
    # shares to what was measured, not to what the machine should have given; proportionality is
    # initial_weights', tests/test_balance.py).
    speeds = re.search(r"in proportion to measured speed \(([\d,]+), ([\d,]+) samples/s\)", out.stdout)
    assert speeds is not None, out.stdout
    fast, slow = (float(x.replace(",", "")) for x in speeds.groups())
    assert sum(first) == 256 and micro_steps == 1 and first[0] != first[1], out.stdout
    assert (first[0] > first[1]) == (fast > slow), out.stdout
    assert rel_diff(final_weights(tmp_path / "speed"), final_weights(one_rank_reference)) < 1e-5


@pytest.mark.slow
def test_rebalancing_evens_out_a_slow_rank(tmp_path):
    """Rank 1 computes 6x slower: the shares move to it less, its compute time comes down to the
    others', and the weights still equal 1 rank's with the whole batch. (6x, not 3x: on a machine
    loaded to 5 runnable processes a core, 3x was within the noise of a 5-step window, and the
    rule rightly waited for evidence that never came in 60 steps.)"""
    args = ["--d-in", "128", "--d-sae", "1024", "--k", "16", "--steps", "60", "--log-every", "5",
            "--checkpoint-every", "0", "--seed", "1", "--eval-rows", "0"]  # (what is checked comes before it)
    ok(main_here("train", *args, "--devices", "cpu:1", "--batch-size", "1024", "--no-db",
                 "--out-dir", str(tmp_path / "one")))
    run_dir = tmp_path / "two"
    out = ok(run_cli("train", *args, "--devices", "cpu:2", "--batch-size", "512", "--out-dir", str(run_dir),
                     env={"SAE_DIST_TEST_SLOW_RANKS": "1:6"}))
    assert "rebalanced shares [512, 512] -> " in out.stdout, out.stdout
    assert rel_diff(final_weights(run_dir), final_weights(tmp_path / "one")) < 1e-5

    from sae_dist.db import get_engine, rank_stats, run_events, step_metrics
    from sae_dist.db.runs import find_run_by_dir

    engine = get_engine()
    run = find_run_by_dir(engine, str(run_dir.resolve()))
    stats = rank_stats(engine, run.id)
    by_step: dict[int, dict[int, object]] = {}
    for s in stats:
        by_step.setdefault(s.step, {})[s.rank] = s
    steps = sorted(by_step)
    first, last = by_step[steps[0]], by_step[steps[-1]]
    assert first[0].batch_size == first[1].batch_size == 512
    assert last[0].batch_size + last[1].batch_size == 1024 and last[1].batch_size < 0.75 * last[0].batch_size
    before = first[1].compute_time_s / first[0].compute_time_s
    after = last[1].compute_time_s / last[0].compute_time_s
    assert before > 1.5 and after < before, (before, after)
    events = [e for e in run_events(engine, run.id) if e.kind == "rebalance"]
    assert events and json.loads(events[0].details_json)["before"] == [512, 512]
    metrics = step_metrics(engine, run.id)
    assert metrics[0].imbalance > 1.5 and all(m.imbalance for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["synthetic", "shards"])
def test_shares_and_rebalancing_never_change_what_is_learnt(tmp_path, source):
    """Rank 1 slowed 3x, rebalancing on: a run stopped at a checkpoint and resumed (equal shares
    first, then wherever timing moved them) equals a straight run on other shares from the start
    (--balance speed): the samples of a step never depend on the shares."""
    # The SAE's forward outweighs making the data here, so the knob makes rank 1 clearly slower.
    args = ["--d-in", "128", "--d-sae", "2048", "--k", "16", "--batch-size", "256", "--devices", "cpu:2",
            "--log-every", "4", "--checkpoint-every", "8", "--seed", "4", "--no-db", *LENGTH_FREE_SCHEDULE,
            "--eval-rows", "0",  # the weights checked are the last checkpoint's: no end-of-run evaluation
            # Other shares round differently (~1e-7); where that flips a latent at the top-k boundary,
            # Adam's first step on it is a whole lr. A small lr keeps such a flip under the 1e-5 checked.
            "--lr", "5e-4"]
    if source == "shards":
        gen = torch.Generator().manual_seed(0)
        write_shards(tmp_path / "acts", [torch.randn(3000, 128, generator=gen) for _ in range(2)])
        args += ["--source", "shards", "--shards-path", str(tmp_path / "acts")]
    slow = {"SAE_DIST_TEST_SLOW_RANKS": "1:3"}
    straight = ok(run_cli("train", *args, "--steps", "16", "--balance", "speed",
                          "--out-dir", str(tmp_path / "straight"), env=slow))
    (first, _), = shares_in(straight.stdout)
    assert first[0] > first[1], straight.stdout  # other shares than the split run's first ones
    ok(run_cli("train", *args, "--steps", "8", "--out-dir", str(tmp_path / "split"), env=slow))
    # The checkpoint holds the shares and the rebalancer's state; the resumed run goes on with both.
    saved = torch.load(latest_checkpoint(tmp_path / "split") / STATE, weights_only=False)
    rebalancer = BalanceState.from_dict(saved["balance"], 2)
    assert len(rebalancer.recent) + rebalancer.moves >= 1
    resumed = ok(run_cli("train", *args, "--steps", "16", "--out-dir", str(tmp_path / "split"), "--resume", env=slow))
    assert shares_in(resumed.stdout) == [(saved["plan"]["shares"], 1)] and "(the checkpoint's shares)" in resumed.stdout
    print("shares:", first, saved["plan"]["shares"],
          [line for line in resumed.stdout.splitlines() if "rebalanced" in line])
    assert rel_diff(final_weights(tmp_path / "split"), final_weights(tmp_path / "straight")) < 1e-5


# 3 ranks x 128, a checkpoint every 4 steps: a run which goes on with 2 of them (resumed on fewer
# devices, or after losing a rank) must end as an uninterrupted run of the same global batch.
THREE_RANKS = [*SMALL, "--checkpoint-every", "4", *LENGTH_FREE_SCHEDULE, "--steps", "8"]


@pytest.fixture(scope="module")
def three_ranks_straight(tmp_path_factory):
    """The uninterrupted run of THREE_RANKS' global batch (3 x 128 = 384), on 1 rank in this
    process: N ranks equal 1 rank with the whole batch (test_train.py's
    test_two_ranks_match_one_rank_and_are_recorded, and test_unequal_shares_give_the_whole_batch_result
    here), and the 3-rank processes are the runs compared with it. --no-db: no state home written."""
    base = tmp_path_factory.mktemp("three_ranks")
    run_dir = base / "straight"
    ok(main_here("train", *THREE_RANKS, "--batch-size", "384", "--devices", "cpu:1", "--no-db",
                 "--out-dir", str(run_dir), env={"SAE_DIST_HOME": str(base / "home")}))
    return run_dir


@pytest.mark.slow
def test_resume_on_fewer_devices_keeps_the_global_batch(tmp_path, three_ranks_straight):
    """A 3-rank checkpoint resumed on 2 ranks: 2 micro-batches of 192 keep the global batch of 384,
    and the weights equal an uninterrupted run's of that global batch."""
    ok(run_cli("train", *THREE_RANKS, "--batch-size", "128", "--devices", "cpu:3", "--no-db", "--steps", "4",
               "--out-dir", str(tmp_path / "split")))
    out = ok(run_cli("train", *THREE_RANKS, "--batch-size", "128", "--devices", "cpu:2", "--no-db",
                     "--out-dir", str(tmp_path / "split"), "--resume"))
    assert "(3 ranks then, 2 now: global batch 384 kept as 2 micro-batches of 192; shares equal)" in out.stdout
    assert shares_in(out.stdout) == [([96, 96], 2)]
    assert rel_diff(final_weights(tmp_path / "split"), final_weights(three_ranks_straight)) < 1e-5


@pytest.mark.slow
def test_killing_one_of_three_ranks_finishes_on_two(tmp_path, three_ranks_straight):
    """Rank 2 SIGKILLs itself after step 6 (KILL_RANK_AT_ENV): the job continues from its last
    checkpoint (step 4) on the other two with the same global batch, and ends with the samples and
    weights of an uninterrupted run of that global batch; the device is recorded as failed."""
    run_dir = tmp_path / "killed"
    result = run_cli("train", *THREE_RANKS, "--batch-size", "128", "--devices", "cpu:3", "--out-dir", str(run_dir),
                     env={"SAE_DIST_DEVICES": "virtual-0,virtual-1,virtual-2", KILL_RANK_AT_ENV: "2:6"})
    stdout, stderr = result.stdout, result.stderr
    assert result.returncode == 0, stderr[-3000:]
    assert "rank 2 (virtual-2): killed by SIGKILL; continuing from step_00000004 on the 2 other devices" in stderr, \
        stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert shares_in(stdout)[-1] == ([96, 96], 2)  # 384 a step: 2 micro-batches of 96 + 96
    assert rel_diff(final_weights(run_dir), final_weights(three_ranks_straight)) < 1e-4

    from sae_dist.db import active_faults, get_engine, run_events, step_metrics
    from sae_dist.db.runs import find_run_by_dir

    engine = get_engine()
    run = find_run_by_dir(engine, str(run_dir.resolve()))
    assert run.status == "COMPLETED" and run.world_size == 2 and run.last_step == 8
    assert step_metrics(engine, run.id)[-1].samples_seen == 8 * 384
    degraded = [e for e in run_events(engine, run.id) if e.kind == "degraded"]
    assert len(degraded) == 1 and json.loads(degraded[0].details_json)["lost_devices"] == ["virtual-2"]
    faults = active_faults(engine)
    assert [(f.device_uuid, f.rank) for f in faults] == [("virtual-2", 2)]
    assert "SIGKILL" in faults[0].reason


@pytest.mark.slow
def test_a_sweep_rebalances_its_stream_like_a_single_run(tmp_path, monkeypatch):
    """A sweep with --balance memory (equal free memory on virtual devices: equal shares first)
    trains every SAE on every device, and rank 1 slowed 6x moves the stream's shares as a single
    run's; each SAE still equals the same SAE trained alone on 1 rank with the whole batch."""
    # lr 5e-4: other shares round differently (~1e-7), and where that flips a latent at the top-k
    # boundary Adam's step on it is a whole lr (at the default lr this config's single run is 1e-4 off).
    args = ["--d-in", "128", "--d-sae", "1024", "--steps", "40", "--log-every", "5", "--checkpoint-every", "0",
            "--seed", "1", "--eval-rows", "0", "--lr", "5e-4"]
    ok(main_here("train", *args, "--k", "16", "--devices", "cpu:1", "--batch-size", "1024", "--no-db",
                 "--out-dir", str(tmp_path / "alone")))
    home = {"SAE_DIST_HOME": str(tmp_path / "home")}
    out = ok(run_cli("train", *args, "--devices", "cpu:2", "--batch-size", "512", "--balance", "memory",
                     "--sweep", "k=8,16", "--out-dir", str(tmp_path / "sweep"), env={**home, SLOW_RANKS_ENV: "1:6"}))
    assert "every SAE on every device" in out.stdout, out.stdout
    moved = re.search(r"rebalanced shares \[512, 512\] -> \[(\d+), (\d+)\]", out.stdout)
    assert moved is not None, out.stdout
    assert int(moved.group(1)) > int(moved.group(2)) and int(moved.group(1)) + int(moved.group(2)) == 1024
    assert rel_diff(final_weights(tmp_path / "sweep" / "saes" / "k16"), final_weights(tmp_path / "alone")) < 1e-5

    monkeypatch.setenv("SAE_DIST_HOME", home["SAE_DIST_HOME"])
    from sae_dist.db import get_engine, run_events
    from sae_dist.db.runs import find_run_by_dir

    engine = get_engine()
    for name in ("k8", "k16"):
        run = find_run_by_dir(engine, str((tmp_path / "sweep" / "saes" / name).resolve()))
        events = [e for e in run_events(engine, run.id) if e.kind == "rebalance"]
        assert run.status == "COMPLETED" and events, name
        assert json.loads(events[0].details_json)["before"] == [512, 512]


@pytest.mark.slow
def test_a_sweep_of_saes_apart_keeps_equal_shares_and_blames_no_balance(tmp_path):
    """Each SAE on a device of its own trains on the whole global batch: rank 1 slowed 6x is not
    a share problem, so the shares stay equal, the log says why, and nothing is rebalanced (the
    rebalancer's own rule would have moved them after 3 windows)."""
    args = ["--d-in", "128", "--d-sae", "1024", "--steps", "30", "--log-every", "5", "--checkpoint-every", "0",
            "--seed", "1", "--eval-rows", "0", "--no-db"]
    out = ok(run_cli("train", *args, "--devices", "cpu:2", "--batch-size", "512", "--sweep", "k=8,16",
                     "--out-dir", str(tmp_path / "sweep"), env={SLOW_RANKS_ENV: "1:6"}))
    assert "the shares change no device's work, so they stay equal" in out.stdout
    assert "rebalanced shares" not in out.stdout and "cannot even it out" not in out.stdout + out.stderr
    assert shares_in(out.stdout) == [([512, 512], 1)]


@pytest.mark.slow
def test_a_sweep_that_loses_a_rank_finishes_on_the_others(tmp_path, three_ranks_straight):
    """A sweep of two SAEs on 3 ranks (k4 on a DDP group of 2, k8 alone on rank 2); rank 2 SIGKILLs
    itself after step 6. The sweep goes on from step 4 on the other two devices, with the global
    batch kept, placed anew (an SAE each), and every SAE ends: k8 as an uninterrupted run of that
    global batch."""
    run_dir = tmp_path / "sweep"
    sweep_args = [a for i, a in enumerate(THREE_RANKS) if a != "--k" and THREE_RANKS[i - 1] != "--k"]
    result = run_cli("train", *sweep_args, "--batch-size", "128", "--devices", "cpu:3", "--sweep", "k=4,8",
                     "--out-dir", str(run_dir),
                     env={"SAE_DIST_HOME": str(tmp_path / "home"), "SAE_DIST_DEVICES": "virtual-0,virtual-1,virtual-2",
                          KILL_RANK_AT_ENV: "2:6"})
    stdout, stderr = result.stdout, result.stderr
    assert result.returncode == 0, stderr[-3000:]
    assert "ranks [0, 1]" in stdout and "ranks [2]" in stdout, stdout
    assert "rank 2 (virtual-2): killed by SIGKILL; continuing from step_00000004 on the 2 other devices" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    assert shares_in(stdout)[-1] == ([96, 96], 2)  # 384 a step: 2 micro-batches of 96 + 96
    for name in ("k4", "k8"):
        assert (run_dir / "saes" / name / "sae" / "cfg.json").is_file(), name
    assert rel_diff(final_weights(run_dir / "saes" / "k8"), final_weights(three_ranks_straight)) < 1e-4


def test_which_failures_blame_a_device():
    assert lost_ranks([Failure(2, -signal.SIGKILL), Failure(0, 1), Failure(1, 1)]) == [2]
    assert lost_ranks([Failure(1, DEVICE_ERROR_EXIT)]) == [1]
    assert lost_ranks([Failure(0, 1)]) == []  # a bug fails again anywhere: no device to blame
    assert lost_ranks([Failure(0, -signal.SIGTERM)]) == []  # a stop, not a failure
    assert lost_ranks([Failure(0, 128 + signal.SIGSEGV)]) == [0]
    assert Failure(2, -9).describe() == "killed by SIGKILL" and Failure(0, 3).describe() == "exit code 3"


def test_survivors_see_only_their_devices(monkeypatch):
    monkeypatch.setenv("SAE_DIST_DEVICES", "GPU-a,GPU-b,GPU-c")
    ids, known = device_ids("cuda", 3)
    assert ids == ["GPU-a", "GPU-b", "GPU-c"] and known
    assert survivors_env("cuda", ids, [1], known) == ({
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-c", "SAE_DIST_DEVICES": "GPU-a,GPU-c", "SAE_DIST_NUM_GPUS": "2"}, "cuda:2")
    assert survivors_env("cpu", ["virtual-0", "virtual-1"], [0], True) == ({
        "SAE_DIST_DEVICES": "virtual-1", "SAE_DIST_NUM_GPUS": "1"}, "cpu:1")
    assert survivors_env("cpu", ["cpu:0", "cpu:1", "cpu:2"], [2], False) == ({}, "cpu:2")
    monkeypatch.delenv("SAE_DIST_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert device_ids("cuda", 2) == (["3", "5"], False)
    assert device_ids("cpu", 2) == (["cpu:0", "cpu:1"], False)


@pytest.mark.slow
def test_bad_slow_rank_knob_is_one_error(tmp_path):
    # Every rank reads the knobs at its start: one device (in this process) shows the error.
    args = [*SMALL, "--steps", "2", "--devices", "cpu:1", "--batch-size", "32", "--no-db"]
    result = main_here("train", *args, "--out-dir", str(tmp_path / "r"), env={SLOW_RANKS_ENV: "1:fast"})
    assert result.returncode == 2
    assert "SAE_DIST_TEST_SLOW_RANKS='1:fast': give rank:value pairs such as 1:3 (rank 1 computes 3x slower" \
        in result.stderr
    result = main_here("train", *SMALL, "--balance", "fastest", "--steps", "2", "--no-db", "--devices", "cpu:1")
    assert result.returncode == 2 and "balance: unknown value 'fastest'" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("raw", ["2", "2:six", "two:6", "2:0", "2:-1"])
def test_bad_kill_rank_knob_is_one_error(tmp_path, raw):
    result = main_here("train", *SMALL, "--steps", "2", "--devices", "cpu:1", "--batch-size", "32", "--no-db",
                        "--out-dir", str(tmp_path / "r"), env={KILL_RANK_AT_ENV: raw})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: SAE_DIST_TEST_KILL_RANK_AT={raw!r}: give rank:value pairs such as 2:15 "
                     "(rank 2 SIGKILLs itself after step 15)"], result.stderr

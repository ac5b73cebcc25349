"""The pure load-balance decisions (sae_dist.balance), with plain numbers."""

import pytest

from sae_dist.balance import (BatchPlan, bounded_split, imbalance, initial_weights, plan_for, rebalance, smoothed_costs,
                              split)


def test_split_is_proportional_whole_and_complete():
    assert split(10, [1, 1]) == (5, 5)
    assert split(10, [3, 1]) == (7, 3) or split(10, [3, 1]) == (8, 2)
    assert sum(split(97, [0.3, 1.7, 2.2])) == 97
    assert split(3, [100, 1, 1]) == (1, 1, 1)  # one each at least
    assert split(6, [float("nan"), 1, 1]) == (2, 2, 2)  # nonsense weights: equal
    with pytest.raises(ValueError, match="cannot share 2 samples among 3"):
        split(2, [1, 1, 1])


def test_bounded_split_keeps_every_share_within_its_bounds():
    # equal share 100: bounds [25, 200]
    assert bounded_split(200, [1, 1]) == (100, 100)
    assert bounded_split(200, [10, 1]) == (175, 25)  # the slow rank stops at a quarter
    assert bounded_split(300, [100, 1, 1]) == (200, 50, 50)  # the fast one at twice
    shares = bounded_split(400, [4, 3, 2, 0.01])
    assert sum(shares) == 400 and min(shares) >= 25 and max(shares) <= 200
    assert shares[3] == 25


def test_plan_for_keeps_the_global_batch_and_the_per_rank_batch():
    assert plan_for(192, 3, 64) == (1, 192)
    assert plan_for(192, 2, 64) == (2, 96)  # 3 ranks lost one: two micro-batches of 48 each
    assert plan_for(192, 1, 64) == (3, 64)
    steps, micro = plan_for(100, 3, 16)  # 100 = 4 x 25 is the first split within 3 x 16
    assert steps * micro == 100 and micro <= 48


def test_batch_plan_offsets_and_loss_scales():
    plan = BatchPlan(global_batch=200, micro_steps=2, shares=(70, 30))
    assert plan.micro_batch == 100 and plan.offset(0) == 0 and plan.offset(1) == 70
    # Rank r's mean loss is a sum over its share / share; DDP divides by 2 ranks; the micro-batches
    # add up: each sample then weighs 1 / global batch.
    for r in range(2):
        assert plan.loss_scale(r) / plan.shares[r] / 2 == pytest.approx(1 / 200)
    assert BatchPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="do not make the global batch"):
        BatchPlan(200, 2, (60, 30))
    with pytest.raises(ValueError, match="at least one sample"):
        BatchPlan(2, 1, (2, 0))


def test_rebalance_moves_samples_from_the_straggler():
    # Rank 1 takes 3x as long for the same share: speeds 1 : 1/3 -> shares 3 : 1.
    d = rebalance((100, 100), [0.10, 0.30], slowest_before=1)
    assert d.changed((100, 100)) and d.shares == (150, 50)
    assert d.imbalance == pytest.approx(3.0) and d.predicted_imbalance == pytest.approx(1.0)
    assert d.limited_rank is None


def test_rebalance_leaves_noise_alone():
    d = rebalance((100, 100), [0.100, 0.110])  # 10%: under the trigger
    assert d.shares == (100, 100) and d.imbalance == pytest.approx(1.1)
    d = rebalance((100, 100), [0.0001, 0.0002])  # 2x, but 0.1 ms apart: jitter
    assert d.shares == (100, 100)
    assert rebalance((100, 100), [0.1, 0.0]).imbalance is None  # a rank measured nothing


def test_rebalance_says_when_it_cannot_help():
    d = rebalance((100, 100), [0.1, 2.0], slowest_before=1)  # 20x slower: even a quarter share leaves it 2.9x behind
    assert d.shares == (175, 25)
    assert d.limited_rank == 1 and d.predicted_imbalance == pytest.approx(0.5 / 0.175)
    again = rebalance(d.shares, [0.175, 0.5])  # at its bound already: no move
    assert again.shares == d.shares and again.limited_rank == 1


def test_rebalance_off_still_measures():
    d = rebalance((100, 100), [0.1, 0.3], allowed=False)
    assert d.shares == (100, 100) and d.imbalance == pytest.approx(3.0) and d.limited_rank is None


def test_initial_weights_by_mode():
    assert initial_weights("equal", [1, 2], [None, None])[0] == [1.0, 1.0]
    weights, why = initial_weights("memory", [8 * 2**30, 4 * 2**30], [None, None])
    assert weights == [8 * 2**30, 4 * 2**30] and "free memory" in why
    assert initial_weights("memory", [None, 4], [None, None])[0] == [1.0, 1.0]
    weights, why = initial_weights("speed", [None, None], [3000.0, 1000.0])
    assert weights == [3000.0, 1000.0] and "speed" in why
    assert "could not" in initial_weights("speed", [None, None], [3000.0, None])[1]


def test_imbalance():
    assert imbalance([1.0, 2.0, 4.0]) == 4.0
    assert imbalance([1.0]) is None


def test_a_straggler_is_one_that_stays_behind():
    assert rebalance((100, 100), [0.10, 0.30]).shares == (100, 100)  # first window: wait and see
    assert rebalance((100, 100), [0.10, 0.30], slowest_before=0).shares == (100, 100)  # another rank
    assert rebalance((100, 100), [0.10, 0.30], slowest_before=1).shares == (150, 50)


def test_smoothed_costs_average_windows():
    assert smoothed_costs(None, (100, 50), [0.1, 0.1]) == [0.001, 0.002]
    assert smoothed_costs([0.001, 0.002], (100, 100), [0.3, 0.1]) == pytest.approx([0.002, 0.0015])
    assert smoothed_costs([0.001, 0.002], (100, 100), [0.3, 0.0]) == [0.001, 0.002]  # a rank measured nothing

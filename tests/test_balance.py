"""The pure load-balance decisions (sae_dist.train.balance), with plain numbers."""

import random

import pytest

from sae_dist.train.balance import (
    EVIDENCE_WINDOWS,
    MAX_MOVES,
    MIN_WINDOW_STEPS,
    REVERSE_WINDOWS,
    BalanceState,
    BatchPlan,
    WindowTimes,
    bounded_split,
    imbalance,
    initial_weights,
    plan_for,
    rebalance,
    slow_ranks,
    split,
)


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


def steady(*medians: float, spread: float = 0.02, steps: int = 10) -> list[WindowTimes]:
    """A window in which every rank's steps sit within +-spread of its median."""
    return [WindowTimes(m * (1 - spread), m, m * (1 + spread), steps) for m in medians]


def run_windows(shares, windows, state=None, allowed=True):
    """Feed windows one by one as the trainer does; (final shares, decisions, window index of each move)."""
    decisions, moves = [], []
    for i, window in enumerate(windows):
        d = rebalance(shares, window, state, allowed)
        if d.changed(shares):
            moves.append(i)
        shares, state = d.shares, d.state
        decisions.append(d)
    return shares, decisions, moves


def test_window_times_are_quartiles_of_the_steps():
    w = WindowTimes.of([0.5, 0.1, 0.2, 0.3, 0.4])
    assert (w.low, w.median, w.high, w.steps) == (pytest.approx(0.2), 0.3, pytest.approx(0.4), 5)
    assert WindowTimes.from_row(w.row()) == w
    assert WindowTimes.of([]).steps == 0


def test_a_rank_is_slow_only_beyond_the_spread():
    assert slow_ranks(steady(0.010, 0.030)) == [1]
    # Medians 1.5x apart, but the steps overlap: rank 1's lower quartile is under 1.2x rank 0's upper.
    assert slow_ranks([WindowTimes(0.008, 0.010, 0.013, 10), WindowTimes(0.012, 0.015, 0.020, 10)]) == []
    assert slow_ranks(steady(0.0001, 0.0003)) == []  # 3x, but 0.2 ms apart: jitter
    assert slow_ranks(steady(0.010, 0.030, steps=MIN_WINDOW_STEPS - 1)) == []  # too few steps to tell
    assert slow_ranks(steady(0.010, 0.030, 0.031)) == [1, 2]  # two slow ranks against the fastest


def test_a_consistently_3x_slower_rank_moves_within_3_windows():
    rng = random.Random(0)
    windows = [[WindowTimes.of([m * rng.lognormvariate(0, 0.1) for _ in range(10)]) for m in (0.010, 0.030)]
               for _ in range(EVIDENCE_WINDOWS)]
    shares, decisions, moves = run_windows((100, 100), windows)
    assert moves == [EVIDENCE_WINDOWS - 1] and shares[0] > 2.5 * shares[1]
    d = decisions[-1]
    assert d.slow_rank == 1 and len(d.evidence) == EVIDENCE_WINDOWS and d.threshold == 1.2
    assert all(ratio >= 1.2 and lo / hi == pytest.approx(ratio) for lo, hi, ratio in d.evidence)
    assert "rank 1 slower for 3 windows running" in d.describe() and "rule: 1.2x in each" in d.describe()
    assert d.state.moves == 1 and d.state.gained == (True, False) and d.state.streak == (0, 0)


def test_the_streak_must_be_the_same_rank_running():
    alternating = [steady(0.010, 0.030), steady(0.030, 0.010)] * 10
    assert run_windows((100, 100), alternating)[2] == []
    broken = [steady(0.010, 0.030), steady(0.010, 0.030), steady(0.010, 0.010), steady(0.010, 0.030)]
    assert run_windows((100, 100), broken)[2] == []
    # A short window (a checkpoint's, the last) neither counts nor breaks the streak.
    short = [steady(0.010, 0.030), steady(0.010, 0.030, steps=2), steady(0.010, 0.030), steady(0.010, 0.030)]
    assert run_windows((100, 100), short)[2] == [3]


def test_noisy_equal_ranks_never_move():
    """Equal ranks on a busy machine: heavy-tailed step times, and now and then a window in which
    one rank was descheduled throughout (1.5x, a random rank). Thousands of windows, no move."""
    rng = random.Random(1)
    windows = []
    for _ in range(3000):
        hogged = rng.randrange(2) if rng.random() < 0.2 else None
        window = []
        for r in range(2):
            times = [0.010 * rng.lognormvariate(0, 0.3) * (rng.choice([1, 1, 1, 3]) if rng.random() < 0.1 else 1)
                     * (1.5 if r == hogged else 1) for _ in range(10)]
            window.append(WindowTimes.of(times))
        windows.append(window)
    shares, decisions, moves = run_windows((512, 512), windows)
    assert moves == [] and shares == (512, 512)
    assert all(d.limited_rank is None for d in decisions)


def test_a_move_back_needs_twice_the_streak():
    # Moved 150/50 off rank 1; now rank 0 (which gained) is the slow one, 1.5x.
    state = run_windows((100, 100), [steady(0.010, 0.030)] * 3)[1][-1].state
    back = [steady(0.015, 0.010)] * REVERSE_WINDOWS
    shares, _, moves = run_windows((150, 50), back, state)
    assert moves == [REVERSE_WINDOWS - 1] and shares[0] < 150
    # A rank that lost share in the last move slowing down again needs only the usual streak.
    shares, _, moves = run_windows((150, 50), [steady(0.010, 0.030)] * 3, state)
    assert moves == [2]


def test_moves_are_capped_then_need_overwhelming_evidence():
    state = BalanceState.fresh(2, moves=MAX_MOVES)
    assert run_windows((100, 100), [steady(0.010, 0.016)] * 20, state)[2] == []  # 1.6x: not any more
    shares, decisions, moves = run_windows((100, 100), [steady(0.010, 0.030)] * 3, state)
    assert moves == [2] and decisions[-1].threshold == 2.0 and decisions[-1].state.moves == MAX_MOVES + 1


def test_the_state_survives_a_checkpoint():
    d = run_windows((100, 100), [steady(0.010, 0.030)] * 2)[1][-1]
    saved = BalanceState.from_dict(d.state.to_dict(), 2)
    assert saved == d.state and saved.streak == (0, 2)
    assert rebalance((100, 100), steady(0.010, 0.030), saved).changed((100, 100))  # the third window
    assert BalanceState.from_dict(d.state.to_dict(), 3) == BalanceState.fresh(3)  # other ranks: anew
    assert BalanceState.from_dict(None, 2) == BalanceState.fresh(2)


def test_rebalance_says_when_it_cannot_help():
    # 20x slower: even a quarter share leaves it 2.9x behind
    shares, decisions, _ = run_windows((100, 100), [steady(0.1, 2.0)] * 3)
    assert shares == (175, 25)
    assert decisions[-1].limited_rank == 1 and decisions[-1].predicted_imbalance == pytest.approx(0.5 / 0.175)
    again = rebalance(shares, steady(0.175, 0.5), decisions[-1].state)  # at its bound already: no move
    assert again.shares == shares and again.limited_rank == 1
    assert again.predicted_imbalance == pytest.approx(0.5 / 0.175)


def test_rebalance_off_still_measures():
    shares, decisions, moves = run_windows((100, 100), [steady(0.1, 0.3)] * 5, allowed=False)
    assert moves == [] and decisions[-1].imbalance == pytest.approx(3.0) and decisions[-1].limited_rank is None
    assert rebalance((100, 100), steady(0.1, 0.0)).imbalance is None  # a rank measured nothing


def test_imbalance_is_the_slowest_time_over_the_fastest():
    assert imbalance([1.0, 2.0, 4.0]) == 4.0

def test_initial_weights_by_mode():
    assert initial_weights("equal", [1, 2], [None, None])[0] == [1.0, 1.0]
    weights, why = initial_weights("memory", [8 * 2**30, 4 * 2**30], [None, None])
    assert weights == [8 * 2**30, 4 * 2**30] and "free memory" in why
    assert initial_weights("memory", [None, 4], [None, None])[0] == [1.0, 1.0]
    weights, why = initial_weights("speed", [None, None], [3000.0, 1000.0])
    assert weights == [3000.0, 1000.0] and "speed" in why
    assert "could not" in initial_weights("speed", [None, None], [3000.0, None])[1]


def test_imbalance_of_a_single_rank_is_none():
    assert imbalance([1.0]) is None



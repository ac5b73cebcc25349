"""The scaling arithmetic against hand-computed cases."""

import math

import pytest

from sae_dist.bench import scaling as s


def test_ring_allreduce_time():
    assert s.allreduce_time(1, 1e9, 1e9) == 0.0
    assert s.allreduce_time(2, 1e9, 1e9) == pytest.approx(1.0)  # 2 * 1/2 * 1 GB / 1 GB/s
    assert s.allreduce_time(4, 1e9, 1e9) == pytest.approx(1.5)  # 2 * 3/4
    assert s.allreduce_time(8, 4e8, 2e9) == pytest.approx(0.35)  # 2 * 7/8 * 0.2 s


def test_strong_projection_splits_compute_and_adds_the_allreduce():
    p = s.project(compute_1_s=1.0, grad_bytes=1e9, bandwidth=1e9, n=2, mode="strong")
    assert p.step_no_overlap_s == pytest.approx(1.5)  # 0.5 compute + 1.0 all-reduce
    assert p.step_overlap_s == pytest.approx(1.0)  # max(0.5, 1.0)
    assert p.speedup_no_overlap == pytest.approx(1 / 1.5)
    assert p.speedup_overlap == pytest.approx(1.0)


def test_weak_projection_keeps_compute_and_multiplies_work():
    p = s.project(compute_1_s=1.0, grad_bytes=1e8, bandwidth=1e9, n=4, mode="weak")
    comm = 2 * 3 / 4 * 0.1  # 0.15 s
    assert p.step_no_overlap_s == pytest.approx(1.0 + comm)
    assert p.speedup_no_overlap == pytest.approx(4 / (1.0 + comm))
    assert p.speedup_overlap == pytest.approx(4.0)  # the all-reduce hides behind the compute


def test_projection_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="strong or weak"):
        s.project(1.0, 1e9, 1e9, 2, mode="diagonal")


def test_break_even_batch():
    # 0.1 s of compute at 4,096 samples; all-reduce of 100 MB over 10 GB/s on 2 devices = 10 ms.
    assert s.break_even_batch(0.1, 4096, 1e8, 1e10, 2) == pytest.approx(409.6)
    assert s.break_even_batch(0.1, 4096, 1e8, 1e10, 1) == 0.0
    assert math.isinf(s.break_even_batch(0.0, 4096, 1e8, 1e10, 2))


def test_speedup_and_efficiencies():
    assert s.speedup(1800.0, 1000.0) == pytest.approx(1.8)
    assert s.efficiency(1.8, 2) == pytest.approx(0.9)
    assert s.efficiency_vs_ceiling(1500.0, 1875.0) == pytest.approx(0.8)


def test_comm_share_is_clamped():
    assert s.comm_share(0.2, 0.15) == pytest.approx(0.25)
    assert s.comm_share(0.2, 0.25) == 0.0  # noise: the step without all-reduce was slower
    assert s.comm_share(0.0, 0.1) == 0.0


def test_median_and_spread():
    assert s.median([3.0, 1.0, 2.0]) == 2.0
    assert s.spread([9.0, 10.0, 11.0]) == pytest.approx(0.1)
    assert s.spread([5.0]) == 0.0
    with pytest.raises(ValueError):
        s.median([])


def test_per_device_batch():
    assert s.per_device_batch("strong", 4096, 4) == 1024
    assert s.per_device_batch("weak", 4096, 4) == 4096
    with pytest.raises(ValueError, match="divisible by 3"):
        s.per_device_batch("strong", 4096, 3)

"""A live page's refresh interval (webui/refresh.py): its base, or twice a slow redraw."""

from webui.refresh import LONGEST_S, refresh_interval


def test_a_fast_or_unmeasured_redraw_keeps_the_base_interval():
    assert refresh_interval(2, None) == 2
    assert refresh_interval(2, 0.3) == 2
    assert refresh_interval(2, 1.0) == 2


def test_a_slow_redraw_waits_twice_its_time_in_half_seconds_up_to_the_longest():
    assert refresh_interval(2, 1.1) == 2.5  # 2.2 rounded up to half seconds
    assert refresh_interval(2, 3.0) == 6
    assert refresh_interval(3, 1.6) == 3.5
    assert refresh_interval(2, 100.0) == LONGEST_S == 30

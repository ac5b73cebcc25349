"""The project's one duration, byte and percent formatter (sae_dist.format), on plain
numbers: what every page, CLI, report and script writes for these quantities."""

from __future__ import annotations

import math

import pytest

from sae_dist import format as fmt

GIB, MIB = 2**30, 2**20


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (45.4, "45 s"), (59.6, "1 min 00 s"), (65, "1 min 05 s"), (185, "3 min 05 s"),
    (3 * 3600 + 5, "3 h 00 min"), (2 * 3600 + 7 * 60, "2 h 07 min"), (90061, "1 d 01 h"),
    (-5, "0 s"),  # a clock that stepped back reads as no time, never as a negative duration
])
def test_duration(seconds, text):
    assert fmt.fmt_duration(seconds) == text


def test_duration_replaces_the_queue_pages_slurm_text():
    # The Queue and Monitor pages wrote SLURM's "1:05", "3:00:05", "1-01:01:01"; every page now
    # writes the Overview's text for the same durations.
    assert fmt.fmt_duration(65) == "1 min 05 s" and fmt.fmt_duration(3 * 3600 + 5) == "3 h 00 min"
    assert fmt.fmt_duration(None) == "—" and fmt.fmt_duration(90061) == "1 d 01 h"


# The scheduler's own byte formatter wrote "512 MiB", "20 GiB", "3 TiB" (no ".0"); every
# message, the scheduler's included, now writes one decimal past bytes, as the app's cards do.
@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (88 * MIB, "88.0 MiB"), (512 * MIB, "512.0 MiB"),
    (20 * GIB, "20.0 GiB"), (int(3.1 * GIB), "3.1 GiB"), (3 * 2**40, "3.0 TiB"), (2.5 * GIB, "2.5 GiB"),
])
def test_bytes(n, text):
    assert fmt.fmt_bytes(n) == text


@pytest.mark.parametrize("fraction, decimals, text", [
    (0.25, 1, "25.0%"), (0.0008, 1, "0.1%"), (1.0, 1, "100.0%"), (0.998, 1, "99.8%"), (0.5, 0, "50%"),
    (0.0, 1, "0.0%"),
])
def test_percent(fraction, decimals, text):
    assert fmt.fmt_percent(fraction, decimals) == text


def test_a_reading_already_in_percent():
    assert fmt.fmt_util(37.4) == "37%" and fmt.fmt_util(0.0) == "0%" and fmt.fmt_util(100) == "100%"


@pytest.mark.parametrize("formatter", [fmt.fmt_duration, fmt.fmt_bytes, fmt.fmt_percent, fmt.fmt_util])
def test_missing_is_a_dash_never_zero(formatter):
    assert formatter(None) == formatter(math.nan) == formatter(math.inf) == "—"


@pytest.mark.parametrize("code, signal, text", [
    (0, None, "0"), (1, None, "1"), (None, 15, "signal 15 (SIGTERM)"), (None, 9, "signal 9 (SIGKILL)"),
    (143, None, "143 · signal 15 (SIGTERM)"),  # 128 + 15: a launcher reporting its child's signal
    (143, 15, "signal 15 (SIGTERM)"), (None, None, "—"), (255, None, "255"), (2, None, "2"),
])
def test_one_exit_format(code, signal, text):
    assert fmt.fmt_exit(code, signal) == text


def test_a_gpu_reads_by_the_start_of_its_uuid_everywhere_it_is_named():
    uuid = "GPU-5f3a2b1c-0d4e-11ef-9a7b-0242ac120002"
    assert fmt.short_device(uuid) == "GPU-5f3a2b1c" and fmt.short_device("cpu:3") == "cpu:3"
    assert fmt.short_devices([uuid, "cpu:0"]) == "GPU-5f3a2b1c, cpu:0" and fmt.short_devices([]) == fmt.MISSING


def test_a_rank_legend_names_the_gpu_in_a_few_characters():
    # A full UUID ran past the legend's width and was cut off ("0 (GPU-00000000-bench-…").
    from sae_dist.analytics import charts

    uuids = [f"GPU-{i:08x}-0d4e-11ef-9a7b-0242ac12000{i}" for i in range(2)]
    times = {"width": 1, "step": [10, 10, 20, 20], "rank": [0, 1, 0, 1], "device": uuids * 2,
             "mean_s": [0.1, 0.2, 0.1, 0.2], "max_s": [0.1, 0.2, 0.1, 0.2], "stragglers": [0, 0, 0, 1]}
    spec = charts.binned_rank_time_chart(times).to_dict()
    labels = {row["rank"] for rows in spec["datasets"].values() for row in rows if "rank" in row}
    assert labels == {"0 (GPU-00000000)", "1 (GPU-00000001)"}


def test_a_name_in_markdown_shows_as_itself():
    """A job's name inside a confirmation drew as Markdown (`*x*` in italics, `:red[x]` in red)."""
    from sae_dist.format import plain_markdown

    assert plain_markdown("e2e-topk (2)") == "e2e-topk (2)"  # nothing to escape mid-line
    assert plain_markdown("*bold* :red[x] $a$ a_b `c`") == "\\*bold\\* :red\\[x\\] \\$a\\$ a\\_b \\`c\\`"

"""Heterogeneous runs in the app: the before/after-rebalancing summary (pure, plain data), the
queries on a real SQLite state database filled through sae_dist.db, and the Monitor and
Benchmarks pages with AppTest. Nothing here times anything."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from sae_dist import format as fmt
from sae_dist.analytics import balance_view as balance
from sae_dist.analytics import bench_charts, charts, queries
from sae_dist.db import DatabaseMetricsLogger, add_run_event, create_run, get_engine, utcnow
from scheduler.store import NewJob, start_jobs, submit
from test_app_monitor_queue import open_page

MONITOR = "pages/2_Monitor.py"
BENCHMARKS = "pages/5_Benchmarks.py"
TIMEOUT = 30  # the first run imports pandas and Altair
LIMITED = "rebalancing cannot even it out"


def window(step: int, rank: int, compute: float, share: int | None, step_time: float = 0.05,
           device: str | None = None) -> dict:
    return {"step": step, "rank": rank, "device": device or f"virtual-{rank}", "batch_size": share,
            "step_time_s": step_time, "compute_time_s": compute, "is_straggler": False}


def rebalance(step: int, before: list[int], after: list[int]) -> dict:
    return {"step": step, "kind": "rebalance", "message": f"shares {before} -> {after}",
            "details": {"before": before, "after": after}}


def two_ranks(steps, shares: dict[int, tuple[int, int]], compute: dict[int, tuple[float, float]]):
    """Windows of ranks 0 and 1 at `steps`; shares/compute keyed by the first step they hold."""
    rows = []
    for step in steps:
        share = shares[max(s for s in shares if s <= step)]
        times = compute[max(s for s in compute if s <= step)]
        rows += [window(step, r, times[r], share[r]) for r in (0, 1)]
    return rows


# ---- before / after: pure ----------------------------------------------------------------------

def test_without_events_every_window_is_before_and_nothing_after():
    windows = two_ranks([5, 10, 15], {5: (128, 128)}, {5: (0.01, 0.03)})
    before, after = balance.split_by_rebalance(windows, [])
    assert before == windows and after == []
    summary = balance.balance_summary(windows, [])
    assert summary["rebalance_steps"] == [] and summary["before_windows"] == 3
    assert summary["after_windows"] == 0
    slow = summary["ranks"][1]
    assert slow["share_before"] == 128 and slow["compute_before_s"] == pytest.approx(0.03)
    assert slow["share_after"] is None and slow["compute_after_s"] is None  # not 0: not measured
    assert summary["imbalance_before"] == pytest.approx(3.0) and summary["imbalance_after"] is None
    assert balance.summary_table(summary)[1]["Share after"] == fmt.MISSING


def test_one_rebalance_splits_at_its_step():
    # Decided from the window ending at 15 (old shares): that window is "before".
    windows = two_ranks(range(5, 31, 5), {5: (128, 128), 20: (192, 64)},
                        {5: (0.01, 0.03), 20: (0.015, 0.016)})
    windows[0]["compute_time_s"] = 0.5  # the first window's warm-up: the median leaves it out
    events = [rebalance(15, [128, 128], [192, 64])]
    summary = balance.balance_summary(windows, events)
    assert summary["rebalance_steps"] == [15]
    assert (summary["before_windows"], summary["after_windows"]) == (3, 3)
    fast, slow = summary["ranks"]
    assert (fast["share_before"], fast["share_after"]) == (128, 192)
    assert (slow["share_before"], slow["share_after"]) == (128, 64)
    assert fast["compute_before_s"] == pytest.approx(0.01)
    assert slow["compute_before_s"] == pytest.approx(0.03)
    assert slow["compute_after_s"] == pytest.approx(0.016)
    assert summary["imbalance_before"] == pytest.approx(3.0)
    assert summary["imbalance_after"] == pytest.approx(0.016 / 0.015)
    table = balance.summary_table(summary)
    assert table[1] == {"Rank": "1", "Device": "virtual-1", "Share before": "128 (50%)",
                        "Share after": "64 (25%)", "Compute before": "30.0 ms",
                        "Compute after": "16.0 ms", "Step before": "50.0 ms", "Step after": "50.0 ms"}


def test_several_rebalances_leave_the_windows_between_out():
    windows = two_ranks(range(5, 41, 5), {5: (128, 128), 15: (160, 96), 25: (192, 64)},
                        {5: (0.01, 0.03), 15: (0.012, 0.02), 25: (0.015, 0.016)})
    events = [rebalance(10, [128, 128], [160, 96]), rebalance(20, [160, 96], [192, 64]),
              {"step": 30, "kind": "balance_limited", "message": "x", "details": {"rank": 1}}]
    before, after = balance.split_by_rebalance(windows, events)
    assert sorted({w["step"] for w in before}) == [5, 10]
    assert sorted({w["step"] for w in after}) == [25, 30, 35, 40]  # 15 and 20: in between
    summary = balance.balance_summary(windows, events)
    assert summary["rebalance_steps"] == [10, 20]
    assert [r["share_after"] for r in summary["ranks"]] == [192, 64]
    metrics = [{"step": s, "samples_per_s": None if s == 5 else 1000.0 + s} for s in range(5, 41, 5)]
    with_metrics = balance.balance_summary(windows, events, metrics)
    assert with_metrics["samples_per_s_before"] == 1010.0  # step 5 not measured: left out
    assert with_metrics["samples_per_s_after"] == pytest.approx(1032.5)


def test_a_rank_on_another_device_after_a_loss_is_another_row():
    # 3 ranks, virtual-1 lost at step 10: virtual-2 continues as rank 1.
    windows = [window(s, r, 0.01, 100, device=f"virtual-{d}") for s in (5, 10) for r, d in
               ((0, 0), (1, 1), (2, 2))]
    windows += [window(s, r, 0.01, 150, device=f"virtual-{d}") for s in (15, 20, 25)
                for r, d in ((0, 0), (1, 2))]
    events = [{"step": 10, "kind": "degraded", "message": "lost", "details": {}},
              rebalance(15, [150, 150], [180, 120])]
    rows = balance.balance_summary(windows, events)["ranks"]
    assert [(r["rank"], r["device"]) for r in rows] == [(0, "virtual-0"), (1, "virtual-1"),
                                                        (1, "virtual-2"), (2, "virtual-2")]
    assert rows[1]["share_before"] == 100 and rows[1]["share_after"] is None  # gone after
    assert rows[2]["share_before"] == 150 and rows[2]["share_after"] == 150


def test_null_shares_stay_unknown():
    windows = two_ranks([5, 10, 15, 20], {5: (None, None)}, {5: (0.01, 0.02)})
    summary = balance.balance_summary(windows, [rebalance(10, [], [])])
    assert [r["share_before"] for r in summary["ranks"]] == [None, None]
    assert summary["imbalance_before"] == pytest.approx(2.0)  # the times were measured
    row = balance.summary_table(summary)[0]
    assert row["Share before"] == row["Share after"] == fmt.MISSING
    # One share known, one not: no percentage of a global batch nobody recorded.
    partial = two_ranks([5], {5: (128, None)}, {5: (0.01, 0.02)})
    assert balance.summary_table(balance.balance_summary(partial, []))[0]["Share before"] == "128"
    assert balance.summary_table(balance.balance_summary([], [])) == []
    assert balance.ratio_text(None, 2.0) == fmt.MISSING and balance.ratio_text(2.0, 3.0) == "1.50×"


def test_rank_time_chart_marks_the_rebalances():
    windows = two_ranks(range(5, 31, 5), {5: (128, 128), 15: (192, 64)}, {5: (0.01, 0.03)})
    events = [rebalance(10, [128, 128], [192, 64]),
              {"step": 20, "kind": "balance_limited", "message": "slow", "details": {}}]
    spec = bench_charts.rank_time_chart(windows, events).to_dict()
    rows = [row for data in spec["datasets"].values() for row in data]
    marks = [row for row in rows if "listing" in row]  # the balance-limited event is not drawn
    assert [(m["step"], m["count"], m["kinds"], m["listing"]) for m in marks] == [
        (10, 1, "rebalanced", "step 10 rebalanced: shares [128, 128] -> [192, 64]")]
    assert {row["share"] for row in rows if "share" in row} == {"128", "192", "64"}
    assert spec["title"]["subtitle"] == "dashed: rebalanced"
    assert bench_charts.rank_time_chart([], events) is None
    with pytest.raises(ValueError):
        bench_charts.rank_time_chart(windows, events, "nonsense")


def test_event_rules_on_the_monitor_curves_only_when_there_are_events():
    curves = {"width": 1, "step": [5, 10, 15], "fvu": [0.5, 0.4, 0.3], "fvu_min": [0.5, 0.4, 0.3],
              "fvu_max": [0.5, 0.4, 0.3]}
    plain = charts.binned_curve(curves, "fvu").to_dict()
    assert plain["mark"]["type"] == "line" and plain["title"] == charts.METRIC_LABELS["fvu"]
    degraded = {"step": 10, "kind": "degraded", "message": "rank 1 lost", "details": {}}
    layered = charts.binned_curve(curves, "fvu", [degraded]).to_dict()
    assert [layer["mark"]["type"] for layer in layered["layer"]] == ["line", "rule"]
    assert layered["title"]["subtitle"] == "dashed: continued on fewer devices"
    many = [rebalance(5 * i, [128, 128], [192, 64]) for i in range(1, 47)]
    dense = charts.binned_curve(curves, "fvu", many).to_dict()
    assert dense["title"]["subtitle"] == "dashed: rebalanced ×46"
    marks = [row for data in dense["datasets"].values() for row in data if "listing" in row]
    assert len(marks) <= 20 and sum(m["count"] for m in marks) == 46


def test_balance_limited_slowdown_is_measured_or_absent():
    latest = [window(20, 0, 0.01, 192), window(20, 1, 0.04, 64)]
    limited = {"step": 20, "kind": "balance_limited", "message": "", "details": {"rank": 1, "slowdown": 3.2}}
    assert fmt.balance_limited_slowdown(1, [limited], latest) == 3.2
    assert fmt.balance_limited_slowdown(1, [], latest) == pytest.approx(4.0)  # from the window
    assert fmt.balance_limited_slowdown(0, [], latest) is None  # not the slowest: no figure
    assert "3.2 times slower than the fastest" in fmt.balance_limited_message(1, 3.2)
    assert "times" not in fmt.balance_limited_message(1, None)
    assert fmt.event_lines([limited] * 12, limit=10)[-1] == "- … and 2 earlier"


# ---- the queries on a real database -------------------------------------------------------------

def make_run(engine, name: str, *, world_size: int = 2, job_id: int | None = None) -> int:
    devices = [f"virtual-{r}" for r in range(world_size)]
    return create_run(engine, name=name, status="RUNNING", architecture="topk",
                      config_json=json.dumps({"architecture": "topk", "balance": "equal"}),
                      world_size=world_size, backend="gloo", device_ids=json.dumps(devices),
                      host="testhost", run_dir=f"/tmp/runs/{name}", total_steps=40, job_id=job_id)


def log_windows(engine, run_id: int, windows: list[dict], limited_from: int | None = None) -> None:
    """Step metrics and rank stats through the trainer's writer; imbalance from the windows
    when shares were recorded (a new trainer), NULL otherwise (an old one)."""
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as writer:
        for step in sorted({w["step"] for w in windows}):
            rows = [w for w in windows if w["step"] == step]
            times = [w["compute_time_s"] for w in rows]
            new = all(w["batch_size"] is not None for w in rows)
            writer.log({"samples_seen": 256 * step, "fvu": 0.5, "l0": 4.0, "loss": 1.0,
                        "samples_per_s": 1000.0 + step,
                        "imbalance": max(times) / min(times) if new else None,
                        "balance_limited_rank": 1 if limited_from and step >= limited_from else None},
                       step)
            writer.log_rank_stats(step, [{k: v for k, v in w.items() if k != "step"} for w in rows])
        writer.update_run(last_step=max(w["step"] for w in windows))


def seed_rebalanced(engine, job_id: int | None = None) -> int:
    run_id = make_run(engine, "rebalanced", job_id=job_id)
    log_windows(engine, run_id, two_ranks(range(5, 41, 5), {5: (128, 128), 15: (192, 64)},
                                          {5: (0.01, 0.03), 15: (0.012, 0.036)}), limited_from=30)
    add_run_event(engine, run_id, 10, "rebalance", "Rebalanced: rank 1 was 3.0x slower; shares "
                  "128/128 -> 192/64", {"before": [128, 128], "after": [192, 64],
                                        "compute_time_s": [0.01, 0.03]})
    add_run_event(engine, run_id, 30, "balance_limited", "Rank 1 stays 3.0x slower at its "
                  "smallest share", {"rank": 1, "slowdown": 3.0})
    return run_id


def seed_old_style(engine, job_id: int | None = None) -> int:
    run_id = make_run(engine, "old-style", job_id=job_id)
    log_windows(engine, run_id, two_ranks(range(5, 21, 5), {5: (None, None)}, {5: (0.01, 0.02)}))
    return run_id


@pytest.fixture
def engine(state_home):
    return get_engine()


def test_queries_read_shares_imbalance_and_events(engine):
    rebalanced = seed_rebalanced(engine)
    old = seed_old_style(engine)
    unequal = make_run(engine, "unequal-from-start")
    log_windows(engine, unequal, two_ranks([5, 10], {5: (160, 96)}, {5: (0.02, 0.02)}))
    equal = make_run(engine, "equal")
    log_windows(engine, equal, two_ranks([5, 10], {5: (128, 128)}, {5: (0.02, 0.02)}))

    found = queries.balanced_runs(engine)
    assert [(r["id"], r["rebalances"]) for r in found] == [(unequal, 0), (rebalanced, 1)]
    assert found[1]["name"] == "rebalanced" and found[1]["world_size"] == 2

    events = queries.run_events(engine, rebalanced)
    assert [(e["step"], e["kind"]) for e in events] == [(10, "rebalance"), (30, "balance_limited")]
    assert events[0]["details"]["after"] == [192, 64] and events[1]["details"]["slowdown"] == 3.0
    assert events[0]["time"].tzinfo is not None
    assert queries.run_events(engine, old) == []

    windows = queries.rank_windows(engine, rebalanced)
    assert len(windows) == 16 and set(windows[0]) == set(queries.WINDOW_COLUMNS)
    assert [w["batch_size"] for w in windows if w["step"] == 40] == [192, 64]
    assert [w["batch_size"] for w in queries.rank_windows(engine, old)] == [None] * 8
    assert [w["step"] for w in queries.latest_rank_window(engine, rebalanced)] == [40, 40]
    assert queries.latest_rank_window(engine, 999) == []
    assert queries.run_rank_stats(engine, rebalanced)["batch_size"][:2] == [128, 128]

    summary = queries.get_run_summary(engine, rebalanced)
    assert summary["balance_limited_rank"] == 1 and summary["imbalance"] == pytest.approx(3.0)
    before = queries.get_run_summary(engine, old)
    assert before["imbalance"] is None and before["balance_limited_rank"] is None

    metrics = balance.rows_from_columns(queries.run_step_metrics(engine, rebalanced, ("samples_per_s",)))
    figures = balance.balance_summary(windows, events, metrics)
    assert [r["share_before"] for r in figures["ranks"]] == [128, 128]
    assert [r["share_after"] for r in figures["ranks"]] == [192, 64]
    assert figures["samples_per_s_before"] == 1007.5 and figures["samples_per_s_after"] == 1027.5


# ---- the pages -------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def app_environment(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")




def running_job(engine, name: str, devices: tuple[str, ...]) -> int:
    job_id = submit(engine, NewJob(name=name, kind="train", argv=["train"], gpus=len(devices),
                                   workdir="/tmp"))
    start_jobs(engine, [(job_id, devices)], {}, now=utcnow())
    return job_id


def page_text(at: AppTest) -> str:
    return "\n".join(str(e.value) for kind in ("markdown", "caption", "info", "warning")
                     for e in getattr(at, kind))


def specs(at: AppTest) -> str:
    return " ".join(str(c.proto.spec) for c in at.get("vega_lite_chart"))


@pytest.mark.slow
def test_monitor_shows_shares_imbalance_events_and_the_limit(engine):
    job = running_job(engine, "hetero", ("virtual-0", "virtual-1"))
    seed_rebalanced(engine, job_id=job)
    at = open_page(MONITOR, job=str(job))
    warnings = [w.value for w in at.warning if LIMITED in w.value]
    assert warnings == ["Rank 1's steps stay 3.0 times slower than the fastest even at its smallest "
                        "share: rebalancing cannot even it out. Give the run devices of a kind, or "
                        "leave this one out."]
    assert {m.label: m.value for m in at.metric}["Imbalance"] == "3.00×"
    shares = next(df.value for df in at.dataframe if "Share" in df.value.columns)
    assert list(shares["Share"]) == ["192 (75%)", "64 (25%)"]
    assert list(shares["Compute time"]) == ["12.0 ms", "36.0 ms"]
    text = page_text(at)
    assert "- step 10 · **rebalanced** · Rebalanced: rank 1 was 3.0x slower" in text
    assert "- step 30 · **balance limited** ·" in text
    toggle = at.toggle(key="monitor_show_events")
    assert not toggle.value and not toggle.disabled  # opt-in: the curves come bare
    assert "dashed:" not in specs(at)
    toggle.set_value(True).run()
    assert not at.exception
    assert "dashed: rebalanced, balance limited" in specs(at)  # marks on the curves


@pytest.mark.slow
def test_monitor_renders_an_old_run_as_before(engine):
    job = running_job(engine, "old", ("virtual-0", "virtual-1"))
    seed_old_style(engine, job_id=job)
    at = open_page(MONITOR, job=str(job))
    assert not any(LIMITED in w.value for w in at.warning)
    assert "Imbalance" not in {m.label for m in at.metric}
    assert not [df for df in at.dataframe if "Share" in df.value.columns]
    assert "Run events" not in page_text(at) and "dashed:" not in specs(at)
    assert at.toggle(key="monitor_show_events").disabled  # nothing to show
    assert "Step time per rank" in specs(at)  # the per-rank chart as before


@pytest.mark.slow
def test_benchmarks_page_compares_before_and_after_rebalancing(engine):
    rebalanced = seed_rebalanced(engine)
    seed_old_style(engine)
    at = open_page(BENCHMARKS)
    assert at.info[0].proto.title == "No benchmark yet"  # the scaling part, without benchmarks
    assert at.selectbox(key="balance_run").value == rebalanced
    assert at.selectbox(key="balance_run").options == [f"{rebalanced} · rebalanced · 2 ranks · "
                                                       "rebalanced 1× · RUNNING"]
    table = next(df.value for df in at.dataframe if "Share before" in df.value.columns)
    assert list(table["Share before"]) == ["128 (50%)", "128 (50%)"]
    assert list(table["Share after"]) == ["192 (75%)", "64 (25%)"]
    assert list(table["Compute after"]) == ["12.0 ms", "36.0 ms"]
    shown = {m.label: m.value for m in at.metric}
    assert shown["Samples/s before"] == "1,008" and shown["Samples/s after"] == "1,028"
    assert shown["Imbalance before"] == "3.00×" and shown["Imbalance after"] == "3.00×"
    assert "Compute time per rank" in specs(at) and "dashed: rebalanced" in specs(at)
    assert "Rebalanced at step 10: 2 report windows before, 6 after." in page_text(at)

    at.segmented_control(key="balance_time_field").set_value("step_time_s").run()
    assert not at.exception and "Step time per rank" in specs(at)


@pytest.mark.slow
def test_benchmarks_page_without_heterogeneous_runs(engine):
    seed_old_style(engine)  # NULL shares, no events: not a heterogeneous run
    at = open_page(BENCHMARKS)
    assert [i.proto.title for i in at.info] == ["No benchmark yet", "No heterogeneous run yet"]
    assert any("--balance speed" in m.value for m in at.markdown) and not at.code


def test_the_imbalance_card_follows_the_rebalancer_s_rule_of_evidence():
    """A figure only when the slowest rank stayed 1.2x the fastest for 3 windows running, 2 ms
    apart; one noisy window of short compute times reads "even" (it read 2.40x on a balanced run
    whose step times were 18.7 and 18.1 ms)."""
    from sae_dist.analytics.balance_view import imbalance_card

    short = [{"rank": 0, "compute_time_s": 0.0005}, {"rank": 1, "compute_time_s": 0.0012}]
    value, help_text = imbalance_card([1.0, 1.1, 2.4], short)
    assert value == "even" and "2.40×" in help_text and "not 1.2x for 3 windows running" in help_text
    assert imbalance_card([1.5, 1.6, 2.4], short)[0] == "even"  # sustained, but 0.7 ms apart: jitter
    slow = [{"rank": 0, "compute_time_s": 0.010}, {"rank": 1, "compute_time_s": 0.024}]
    value, help_text = imbalance_card([1.5, 1.6, 2.4], slow)
    assert value == "2.40×" and "the rebalancer's rule" in help_text and "14.0 ms apart" in help_text
    assert imbalance_card([2.4, 2.4], slow)[0] == "even"  # two windows are not yet evidence
    assert imbalance_card([], slow) is None and imbalance_card([1.3, None], slow) is None


def test_feature_recovery_says_its_ceiling_when_latents_are_fewer_than_planted_features():
    from sae_dist.analytics.cards import recovery_ceiling

    few = {"source": "synthetic", "d_in": 64, "expansion_factor": 6, "d_sae": None, "synthetic_features": 4096}
    assert recovery_ceiling(few) == ("384 latents for 4,096 planted features: at most 9.4% of them can be "
                                     "recovered, whatever the training.")
    assert recovery_ceiling({**few, "d_sae": 8192}) is None  # enough latents: no ceiling below 100%
    assert recovery_ceiling({**few, "source": "shards"}) is None  # the count is the shards' own
    assert recovery_ceiling({}) is None

"""A heterogeneous run as the Benchmarks page shows it: each rank's share and times before and after rebalancing.

The Benchmarks page and `scripts/bench_balance.py` read a run through these definitions:

- a *report window* is one rank_stats row: a rank's median step and compute times over the
  steps since the previous report (ending at `step`) and its share of each step's batch in
  them (`batch_size`, None on runs from before shares were recorded);
- a rebalance event at step e was decided from the windows ending at e; the new shares apply
  from step e + 1;
- *before* = the windows ending at or before the first rebalance's step (the first shares,
  the window that triggered the rebalance included); *after* = the windows ending after the
  last rebalance's step (the final shares). Windows between the first and the last rebalance
  are in neither. A run never rebalanced has every window before and none after;
- over a period, a rank's time is the median of its windows (the first window's warm-up does
  not drag it) and its share the last one recorded in the period.

Pure functions on plain data (lists of dicts from `sae_dist.analytics.queries`); the chart
of these figures is `sae_dist.analytics.bench_charts.rank_time_chart`.
"""

from __future__ import annotations

import statistics
from typing import Any

from sae_dist.format import MISSING, fmt_ratio, fmt_seconds, fmt_share
from sae_dist.train.balance import EVIDENCE_WINDOWS, MIN_GAP_S, REBALANCE_AT


def rebalance_steps(events: list[dict]) -> list[int]:
    """The steps at which the shares were rebalanced, in order."""
    return sorted(e["step"] for e in events if e["kind"] == "rebalance")


def split_by_rebalance(rows: list[dict], events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(before, after): the rows (anything with a "step": windows, step metrics) before the
    first rebalance and after the last one, as the module docstring defines them."""
    steps = rebalance_steps(events)
    if not steps:
        return list(rows), []
    first, last = steps[0], steps[-1]
    return [r for r in rows if r["step"] <= first], [r for r in rows if r["step"] > last]


def median_or_none(values: list[float | None]) -> float | None:
    """The median of the measured values; None when none was measured (never 0)."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def last_known(values: list[Any]) -> Any:
    """The last value that is not None; None when all are."""
    return next((v for v in reversed(values) if v is not None), None)


def rows_from_columns(columns: dict[str, list]) -> list[dict[str, Any]]:
    """Column-wise data ({"step": [...], name: [...]}, as `queries.run_step_metrics`) as rows."""
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*columns.values())]


def rank_keys(windows: list[dict]) -> list[tuple[int, str | None]]:
    """(rank, device) of every rank in the windows, by rank. Keyed by both: a run that continued
    on fewer devices renumbers its ranks, and the same rank on another device is another row."""
    keys = dict.fromkeys((w["rank"], w["device"]) for w in windows)
    return sorted(keys, key=lambda key: key[0])  # stable: a rank's devices in order of use


def period_by_rank(windows: list[dict]) -> dict[tuple[int, str | None], dict[str, Any]]:
    """Each rank's figures over a period: {(rank, device): {"share", "compute_s", "step_s",
    "windows"}}."""
    by_rank: dict[tuple[int, str | None], list[dict]] = {}
    for window in windows:
        by_rank.setdefault((window["rank"], window["device"]), []).append(window)
    return {key: {"share": last_known([w["batch_size"] for w in rows]),
                  "compute_s": median_or_none([w["compute_time_s"] for w in rows]),
                  "step_s": median_or_none([w["step_time_s"] for w in rows]),
                  "windows": len(rows)}
            for key, rows in by_rank.items()}


def imbalance(figures: dict[Any, dict[str, Any]]) -> float | None:
    """Slowest rank's compute time / fastest's over a period (1.0 = even); None unless every
    rank's was measured and above zero."""
    times = [f["compute_s"] for f in figures.values()]
    if len(times) < 2 or any(t is None or t <= 0 for t in times):
        return None
    return max(times) / min(times)


def balance_summary(windows: list[dict], events: list[dict],
                    metrics: list[dict] | None = None) -> dict[str, Any]:
    """Before and after rebalancing, per rank and for the run.

    `windows`: rank_stats rows (step, rank, device, batch_size, step_time_s, compute_time_s);
    `events`: run_events (step, kind, ...); `metrics`: optional step_metrics rows (step,
    samples_per_s). Returns {"rebalance_steps", "before_windows", "after_windows" (report
    steps in each period), "ranks": [one per (rank, device): {"rank", "device",
    "share_before", "share_after", "compute_before_s", "compute_after_s", "step_before_s",
    "step_after_s"}], "imbalance_before", "imbalance_after", "samples_per_s_before",
    "samples_per_s_after"}.
    An after-figure is None when the run never rebalanced; any figure is None when not recorded.
    """
    before, after = split_by_rebalance(windows, events)
    early, late = period_by_rank(before), period_by_rank(after)
    ranks = []
    for key in rank_keys(windows):
        a, b = early.get(key, {}), late.get(key, {})
        ranks.append({"rank": key[0], "device": key[1],
                      "share_before": a.get("share"), "share_after": b.get("share"),
                      "compute_before_s": a.get("compute_s"), "compute_after_s": b.get("compute_s"),
                      "step_before_s": a.get("step_s"), "step_after_s": b.get("step_s")})
    metrics_before, metrics_after = split_by_rebalance(metrics or [], events)
    return {
        "rebalance_steps": rebalance_steps(events),
        "before_windows": len({w["step"] for w in before}),
        "after_windows": len({w["step"] for w in after}),
        "ranks": ranks,
        "imbalance_before": imbalance(early),
        "imbalance_after": imbalance(late),
        "samples_per_s_before": median_or_none([m.get("samples_per_s") for m in metrics_before]),
        "samples_per_s_after": median_or_none([m.get("samples_per_s") for m in metrics_after]),
    }


def summary_table(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The per-rank rows of `balance_summary` as display strings ("—": not recorded)."""
    total_before = _total([r["share_before"] for r in summary["ranks"]])
    total_after = _total([r["share_after"] for r in summary["ranks"]])
    return [{"Rank": str(r["rank"]), "Device": r["device"] or MISSING,
             "Share before": fmt_share(r["share_before"], total_before),
             "Share after": fmt_share(r["share_after"], total_after),
             "Compute before": fmt_seconds(r["compute_before_s"]),
             "Compute after": fmt_seconds(r["compute_after_s"]),
             "Step before": fmt_seconds(r["step_before_s"]),
             "Step after": fmt_seconds(r["step_after_s"])}
            for r in summary["ranks"]]


def ratio_text(before: float | None, after: float | None) -> str:
    """after / before as "1.42×"; "—" when either is unknown."""
    if before is None or after is None or before <= 0:
        return MISSING
    return fmt_ratio(after / before)


def _total(shares: list[int | None]) -> int | None:
    # The global batch only when every rank's share is known: a partial sum would mislead.
    return sum(shares) if shares and all(s is not None for s in shares) else None


def imbalance_card(recent: list[float | None], window: list[dict]) -> tuple[str, str] | None:
    """The Monitor's Imbalance card as (value, help), under the rebalancer's own rule of evidence
    (sae_dist.train.balance), on what the run recorded (each window's medians; the rebalancer
    itself reads quartiles): a figure only when the slowest rank's compute time stayed REBALANCE_AT
    x the fastest's for EVIDENCE_WINDOWS report windows running (`recent`, oldest first) and sits
    MIN_GAP_S above it in the latest `window` (its ranks' rows); else "even", with the latest
    figure in the help, said to be within the noise. None before any window was measured."""
    latest = recent[-1] if recent else None
    if latest is None:
        return None
    times = [w["compute_time_s"] for w in window if w.get("compute_time_s") is not None]
    gap = max(times) - min(times) if len(times) > 1 else None
    last = recent[-EVIDENCE_WINDOWS:]
    sustained = len(last) == EVIDENCE_WINDOWS and all(r is not None and r >= REBALANCE_AT for r in last)
    apart = f", {fmt_seconds(gap)} apart" if gap is not None else ""
    if sustained and gap is not None and gap >= MIN_GAP_S:
        return fmt_ratio(latest), (f"The slowest rank's compute time over the fastest's: at least {REBALANCE_AT:.1f}x "
                                   f"for {EVIDENCE_WINDOWS} report windows running (the rebalancer's rule){apart}.")
    return "even", (f"The latest window measured {fmt_ratio(latest)}{apart}, but not {REBALANCE_AT:.1f}x for "
                    f"{EVIDENCE_WINDOWS} windows running, {fmt_seconds(MIN_GAP_S)} apart (the rebalancer's rule): "
                    "within the noise of short compute times, not a slow rank.")

"""Rebalancing against a slow rank: one small job on CPU ranks, one rank slowed, trained twice.

    .venv/bin/python scripts/bench_balance.py                      # cpu:2, rank 1 3x slower, 60 steps
    .venv/bin/python scripts/bench_balance.py --slow-ranks 1:2 --steps 100 --batch-size 512

The same synthetic job runs once with --no-rebalance and once with rebalancing on (the
default), each as a real `python -m sae_dist train` subprocess against a temporary
SAE_DIST_HOME, so that each records to a state database of its own. SAE_DIST_TEST_SLOW_RANKS
(the trainer's test knob: a sleep proportional to the rank's measured compute) slows a rank.
The figures are read back from the databases: throughput is the median of
step_metrics.samples_per_s over the report windows after the warm-up ones; per rank, the
share and the times of the first and last report windows. The ratio between the runs is
measured in this one run of the script; nothing is asserted about time (a shared machine is
noisy: run it again, or longer, before trusting a difference of a few percent).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sae_dist.analytics import queries  # noqa: E402
from sae_dist.analytics.format import MISSING, fmt_ratio  # noqa: E402
from sae_dist.bench import balance  # noqa: E402
from sae_dist.db import get_engine  # noqa: E402

SLOW_ENV = "SAE_DIST_TEST_SLOW_RANKS"
RUNS = (("no rebalance", ["--no-rebalance"]), ("rebalance", []))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu:2", help="the trainer's --devices (default cpu:2)")
    p.add_argument("--slow-ranks", default="1:3",
                   help=f"{SLOW_ENV}: rank:factor[,rank:factor] (default 1:3, rank 1 three times slower)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=5, help="steps per report window (default 5)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per device per step (default 256)")
    p.add_argument("--d-in", type=int, default=256)
    p.add_argument("--expansion-factor", type=int, default=8)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--warmup-windows", type=int, default=2,
                   help="report windows left out of the throughput (default 2)")
    p.add_argument("--keep", type=Path, help="keep the state homes and runs here (default: a temporary directory)")
    return p.parse_args()


def train(label: str, extra: list[str], args: argparse.Namespace, home: Path) -> None:
    """One `python -m sae_dist train` into `home`; exits the script with its output on failure."""
    cmd = [sys.executable, "-m", "sae_dist", "train", "--devices", args.devices,
           "--steps", str(args.steps), "--log-every", str(args.log_every),
           "--batch-size", str(args.batch_size), "--d-in", str(args.d_in),
           "--expansion-factor", str(args.expansion_factor), "--k", str(args.k),
           "--checkpoint-every", "0", "--out-dir", str(home / "run"),
           "--name", f"balance-{label.replace(' ', '-')}", *extra]
    env = {**os.environ, "SAE_DIST_HOME": str(home), SLOW_ENV: args.slow_ranks}
    env.pop("SAE_DIST_DB_URL", None)  # its own SQLite database, never the user's
    print(f"training, {label}: {' '.join(cmd[1:])}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"training ({label}) failed with exit code {done.returncode}")
    print(f"  done in {time.perf_counter() - started:.1f} s", flush=True)


def read_run(home: Path) -> dict:
    """The run recorded in `home`'s database: its windows, events and step metrics."""
    engine = get_engine(f"sqlite:///{home / 'state.db'}")
    runs = queries.list_runs(engine, limit=1)
    if not runs:
        raise SystemExit(f"no training run recorded in {home / 'state.db'}")
    run_id = runs[0]["id"]
    metrics = queries.run_step_metrics(engine, run_id, ("samples_per_s", "imbalance"))
    return {"windows": queries.rank_windows(engine, run_id),
            "events": queries.run_events(engine, run_id),
            "metrics": balance.rows_from_columns(metrics)}


def throughput(run: dict, warmup_windows: int) -> tuple[float | None, int]:
    """Median samples/s over the windows after the warm-up, and how many windows that is."""
    values = [m["samples_per_s"] for m in run["metrics"][warmup_windows:]]
    return balance.median_or_none(values), sum(v is not None for v in values)


def window_at(run: dict, step: int) -> dict[tuple[int, str], dict]:
    return balance.period_by_rank([w for w in run["windows"] if w["step"] == step])


def fmt_ms(seconds: float | None) -> str:
    return MISSING if seconds is None else f"{1000 * seconds:.1f}"


def fmt_int(value: int | None) -> str:
    return MISSING if value is None else f"{value:,}"


def print_throughput(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\n| run | samples/s (median, windows after {args.warmup_windows} warm-up) | windows "
          "| compute slowest / fastest, first -> last window | rebalances |\n|---|---|---|---|---|")
    for label, run in results.items():
        rate, n = throughput(run, args.warmup_windows)
        steps = sorted({w["step"] for w in run["windows"]})
        first, last = (balance.imbalance(window_at(run, s)) for s in (steps[0], steps[-1]))
        rebalances = len(balance.rebalance_steps(run["events"]))
        print(f"| {label} | {MISSING if rate is None else f'{rate:,.0f}'} | {n} "
              f"| {fmt_ratio(first)} -> {fmt_ratio(last)} | {rebalances} |")
    off, on = (throughput(results[label], args.warmup_windows)[0] for label, _ in RUNS)
    ratio = on / off if on is not None and off else None
    print(f"\nrebalance / no rebalance: {MISSING if ratio is None else f'{ratio:.2f}x'} samples/s")


def print_ranks(results: dict[str, dict]) -> None:
    print("\n| run | rank | device | share first | share last | compute first (ms) | compute last (ms) "
          "| step first (ms) | step last (ms) |\n|---|---|---|---|---|---|---|---|---|")
    for label, run in results.items():
        steps = sorted({w["step"] for w in run["windows"]})
        first, last = window_at(run, steps[0]), window_at(run, steps[-1])
        for rank, device in balance.rank_keys(run["windows"]):
            a, b = first.get((rank, device), {}), last.get((rank, device), {})
            print(f"| {label} | {rank} | {device} | {fmt_int(a.get('share'))} "
                  f"| {fmt_int(b.get('share'))} | {fmt_ms(a.get('compute_s'))} | {fmt_ms(b.get('compute_s'))} "
                  f"| {fmt_ms(a.get('step_s'))} | {fmt_ms(b.get('step_s'))} |")
    print(f"first window: step {steps[0]}, last: step {steps[-1]}")


def print_before_after(run: dict) -> None:
    """The rebalancing run as the Benchmarks page shows it (sae_dist.bench.balance's periods)."""
    summary = balance.balance_summary(run["windows"], run["events"], run["metrics"])
    if not summary["rebalance_steps"]:
        return
    table = balance.summary_table(summary)
    print(f"\nbefore (windows up to step {summary['rebalance_steps'][0]}) and after (windows past step "
          f"{summary['rebalance_steps'][-1]}) rebalancing, medians over "
          f"{summary['before_windows']} and {summary['after_windows']} windows:")
    print("\n| " + " | ".join(table[0]) + " |\n|" + "---|" * len(table[0]))
    for row in table:
        print("| " + " | ".join(row.values()) + " |")
    print(f"imbalance {fmt_ratio(summary['imbalance_before'])} -> {fmt_ratio(summary['imbalance_after'])}, "
          f"samples/s {balance.ratio_text(summary['samples_per_s_before'], summary['samples_per_s_after'])} "
          "after / before")


def print_events(run: dict) -> None:
    if not run["events"]:
        print("\nthe rebalancing run recorded no run event: the trainer did not rebalance "
              f"(does it read {SLOW_ENV} and record run_events yet?)")
        return
    print("\nevents of the rebalancing run:")
    for event in run["events"]:
        print(f"  step {event['step']}: {event['kind']}: {event['message']}")


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        root = args.keep or Path(tmp)
        print(f"{SLOW_ENV}={args.slow_ranks}; {args.steps} steps on {args.devices}, "
              f"{args.batch_size} samples per device per step; state homes under {root}")
        results = {}
        for label, extra in RUNS:
            home = root / label.replace(" ", "-")
            train(label, extra, args, home)
            results[label] = read_run(home)
        if any(not run["windows"] for run in results.values()):
            raise SystemExit("a run recorded no per-rank window: nothing to compare")
        print_throughput(results, args)
        print_ranks(results)
        print_before_after(results["rebalance"])
        print_events(results["rebalance"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

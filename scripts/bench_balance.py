"""Rebalancing on CPU ranks, two cases, each a real `python -m sae_dist train` subprocess:

    .venv/bin/python scripts/bench_balance.py                      # both cases (a few minutes)
    .venv/bin/python scripts/bench_balance.py --case slow --compare

(a) `hog`: 2 equal ranks for --hog-steps steps while --hogs CPU hogs (`python3 -c 'while True:
    pass'`, started here and killed at the end) compete for the cores: noise, not skew. Counts the
    rebalance events (goal: at most 1).
(b) `slow`: rank 1 made slower by SAE_DIST_TEST_SLOW_RANKS (default 1:3, a sleep proportional to
    its measured compute). Reports the report window of the first rebalance (goal: within 3) and
    the moves after it (goal: at most 2); --compare also runs it with --no-rebalance and compares
    the throughput (the median of step_metrics.samples_per_s after the warm-up windows).

Each run records to a state database of its own (a temporary SAE_DIST_HOME). Nothing is asserted
about time: a shared machine is noisy; run it again, or longer, before trusting a few percent.
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

from sae_dist.analytics import balance_view as balance  # noqa: E402
from sae_dist.analytics import queries  # noqa: E402
from sae_dist.contract import SLOW_RANKS_ENV  # noqa: E402
from sae_dist.db import get_engine  # noqa: E402
from sae_dist.format import MISSING, fmt_ratio  # noqa: E402

RUNS = (("no rebalance", ["--no-rebalance"]), ("rebalance", []))
HOG = "while True: pass"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("hog", "slow", "both"), default="both")
    p.add_argument("--devices", default="cpu:2", help="the trainer's --devices (default cpu:2)")
    p.add_argument("--hogs", type=int, default=1, help="CPU hogs during case hog (default 1)")
    p.add_argument("--hog-steps", type=int, default=600)
    p.add_argument("--slow-ranks", default="1:3",
                   help=f"{SLOW_RANKS_ENV} for case slow: rank:factor[,rank:factor] (default 1:3)")
    p.add_argument("--steps", type=int, default=200, help="steps of case slow (default 200)")
    p.add_argument("--compare", action="store_true", help="case slow: also run --no-rebalance, compare samples/s")
    p.add_argument("--log-every", type=int, default=10, help="steps per report window (default 10)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per device per step (default 256)")
    p.add_argument("--d-in", type=int, default=128)
    p.add_argument("--expansion-factor", type=int, default=8)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--warmup-windows", type=int, default=2,
                   help="report windows left out of the throughput (default 2)")
    p.add_argument("--keep", type=Path, help="keep the state homes and runs here (default: a temporary directory)")
    return p.parse_args()


def train(label: str, extra: list[str], args: argparse.Namespace, home: Path, steps: int,
          env_extra: dict[str, str]) -> None:
    """One `python -m sae_dist train` into `home`; exits the script with its output on failure."""
    cmd = [sys.executable, "-m", "sae_dist", "train", "--devices", args.devices,
           "--steps", str(steps), "--log-every", str(args.log_every),
           "--batch-size", str(args.batch_size), "--d-in", str(args.d_in),
           "--expansion-factor", str(args.expansion_factor), "--k", str(args.k),
           "--checkpoint-every", "0", "--out-dir", str(home / "run"),
           "--name", f"balance-{label.replace(' ', '-')}", *extra]
    env = {**os.environ, "SAE_DIST_HOME": str(home), **env_extra}
    env.pop("SAE_DIST_DB_URL", None)  # its own SQLite database, never the user's
    if SLOW_RANKS_ENV not in env_extra:
        env.pop(SLOW_RANKS_ENV, None)
    print(f"training, {label}: {' '.join(f'{k}={v}' for k, v in env_extra.items())} {' '.join(cmd[1:])}", flush=True)
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
    """The rebalancing run as the Benchmarks page shows it (sae_dist.analytics.balance_view's periods)."""
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


def print_rebalances(run: dict, log_every: int) -> list[int]:
    steps = balance.rebalance_steps(run["events"])
    for event in run["events"]:
        print(f"  step {event['step']} (window {event['step'] // log_every}): {event['kind']}: {event['message']}")
    return steps


def case_hog(args: argparse.Namespace, root: Path) -> None:
    print(f"\n## (a) 2 equal ranks, {args.hog_steps} steps, {args.hogs} CPU hog(s) running", flush=True)
    hogs = [subprocess.Popen(["python3", "-c", HOG]) for _ in range(args.hogs)]
    try:
        home = root / "hog"
        train("equal ranks + hog", [], args, home, args.hog_steps, {})
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    run = read_run(home)
    imbalances = [m["imbalance"] for m in run["metrics"] if m.get("imbalance")]
    windows = len(run["metrics"])
    moves = print_rebalances(run, args.log_every)
    print(f"\nhog: {len(moves)} rebalance event(s) in {windows} report windows (goal: at most 1); "
          f"window imbalance (median compute slowest / fastest) "
          f"median {fmt_ratio(balance.median_or_none(imbalances))}, "
          f"max {fmt_ratio(max(imbalances) if imbalances else None)}")


def case_slow(args: argparse.Namespace, root: Path) -> None:
    print(f"\n## (b) {SLOW_RANKS_ENV}={args.slow_ranks}, {args.steps} steps", flush=True)
    results = {}
    for label, extra in (RUNS if args.compare else RUNS[1:]):
        home = root / label.replace(" ", "-")
        train(label, extra, args, home, args.steps, {SLOW_RANKS_ENV: args.slow_ranks})
        results[label] = read_run(home)
    run = results["rebalance"]
    if not run["windows"]:
        raise SystemExit("the run recorded no per-rank window")
    moves = print_rebalances(run, args.log_every)
    first = f"window {moves[0] // args.log_every} (step {moves[0]})" if moves else "never"
    print(f"\nslow: first rebalance at {first} (goal: within 3 windows), {max(0, len(moves) - 1)} further "
          f"move(s) (goal: at most 2)")
    if args.compare:
        print_throughput(results, args)
    print_ranks(results)
    print_before_after(run)


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        root = args.keep or Path(tmp)
        print(f"{args.devices}, {args.batch_size} samples per device per step, d_in {args.d_in} x "
              f"{args.expansion_factor}, k {args.k}, a report every {args.log_every} steps; state homes under {root}")
        if args.case in ("hog", "both"):
            case_hog(args, root)
        if args.case in ("slow", "both"):
            case_slow(args, root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

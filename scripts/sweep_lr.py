"""The learning-rate sweep behind sae-dist's default lr, warm-up, decay and dead-latent window.

Each point trains one SAE with the real trainer (`python -m sae_dist train`, one CPU rank) on
planted data (the truth is known) or on harvested activations, then evaluates it on rows the run
never trained on with the same evaluator as `python -m sae_dist evaluate`. Per shape the lr grid
starts at a guess times 1/2, 1, 2 and grows by factors of 2 past whichever end is best, so the
best lr is always an interior point (or the grid says it is not).

    .venv/bin/python scripts/sweep_lr.py --out sweep/        # every shape, then the ablations
    .venv/bin/python scripts/sweep_lr.py --out sweep/ --shapes p1,p2 --no-ablations
    .venv/bin/python scripts/sweep_lr.py --out sweep/ --table   # print the table of what is done

Results append to OUT/results.jsonl (one line a point); a rerun skips points already there, so
an interrupted sweep continues. On 2 CPU cores the whole sweep takes about an hour and a half.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sae_dist.config import TrainConfig  # noqa: E402
from sae_dist.data.sources.synthetic import SyntheticSource  # noqa: E402
from sae_dist.defaults import default_lr  # noqa: E402
from sae_dist.evaluate import Planted, evaluate_sae, heldout_rows, load_sae, planted_from_settings  # noqa: E402

HELDOUT = 16384  # rows each SAE is evaluated on
REFERENCE = {"d_in": 256, "batch": 1024, "d_sae": 4096, "k": 16}  # the rule's terms are ratios to these


@dataclass(frozen=True)
class Shape:
    name: str
    d_in: int
    d_sae: int
    k: int
    batch: int
    samples: int
    architecture: str = "topk"
    features: int = 0  # planted features (0: harvested data, see `shards`)
    active: float = 8.0
    power_law: float = 0.5
    shards: str | None = None  # a harvested shard directory; its tail is held out
    note: str = ""

    @property
    def steps(self) -> int:
        return self.samples // self.batch


SHAPES = [
    Shape("p1", d_in=256, d_sae=4096, k=16, batch=1024, samples=2**20, features=2048, active=8, power_law=0.5),
    Shape("m1", d_in=384, d_sae=3072, k=32, batch=1024, samples=2**20, shards="minilm",
          note="MiniLM-L6 layer 3 resid over Node.js docs"),
    Shape("p5", d_in=1024, d_sae=4096, k=64, batch=2048, samples=2**18, features=1024, active=16, power_law=0.75,
          note="a quarter of the budget: d_in 1024 on 2 cores"),
    Shape("p3", d_in=512, d_sae=2048, k=32, batch=4096, samples=2**20, features=1024, active=16, power_law=0.75),
    Shape("p6", d_in=128, d_sae=1024, k=128, batch=8192, samples=2**20, features=256, active=32, power_law=0.5),
    Shape("p4", d_in=128, d_sae=16384, k=16, batch=1024, samples=2**19, features=2048, active=8, power_law=1.0,
          note="half the budget: 16k latents on 2 cores"),
    Shape("p1b", d_in=256, d_sae=4096, k=16, batch=1024, samples=2**20, features=2048, active=8, power_law=0.5,
          architecture="batchtopk"),
    Shape("p2", d_in=64, d_sae=2048, k=8, batch=256, samples=2**20, features=256, active=4, power_law=1.0),
]


@dataclass(frozen=True)
class Point:
    shape: Shape
    lr: float
    warmup: int | None = None  # None: the default rule
    decay: float | None = None
    dead_after: int | None = None
    tag: str = "lr"

    @property
    def key(self) -> str:
        parts = [self.shape.name, f"lr{self.lr:.3g}"]
        if self.warmup is not None:
            parts.append(f"w{self.warmup}")
        if self.decay is not None:
            parts.append(f"d{self.decay:g}")
        if self.dead_after is not None:
            parts.append(f"dead{self.dead_after}")
        return "-".join(parts)


def train_argv(p: Point, run_dir: Path, data_root: Path) -> list[str]:
    s = p.shape
    argv = [sys.executable, "-m", "sae_dist", "train", "--no-db", "--devices", "cpu:1",
            "--architecture", s.architecture, "--d-in", str(s.d_in), "--d-sae", str(s.d_sae), "--k", str(s.k),
            "--batch-size", str(s.batch), "--steps", str(s.steps), "--lr", f"{p.lr:g}",
            "--checkpoint-every", "0", "--keep-checkpoints", "1", "--log-every", str(max(1, s.steps // 8)),
            "--out-dir", str(run_dir), "--seed", "0"]
    if s.shards:
        argv += ["--source", "shards", "--shards-path", str(data_root / s.shards)]
    else:
        argv += ["--synthetic-features", str(s.features), "--synthetic-active", str(s.active),
                 "--synthetic-power-law", str(s.power_law)]
    for flag, value in (("--lr-warmup-steps", p.warmup), ("--lr-decay-fraction", p.decay),
                        ("--dead-after-samples", p.dead_after)):
        if value is not None:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def heldout_for(s: Shape, data_root: Path) -> tuple[torch.Tensor, Planted | None]:
    if s.shards:
        return heldout_rows(data_root / s.shards, HELDOUT), None
    src = SyntheticSource(d_in=s.d_in, n_features=s.features, active=s.active, power_law=s.power_law,
                          noise=0.01, seed=0, rank=0, world_size=1, batch_size=s.batch)
    # Stream positions after the run's last sample: rows the run never trained on.
    rows = src.samples(s.samples, HELDOUT)
    return rows, planted_from_settings(s.d_in, s.features, s.active, s.power_law, noise=0.01, seed=0)


def run_point(p: Point, out: Path, data_root: Path) -> dict:
    run_dir = out / "runs" / p.key
    export = run_dir / "sae"
    started = time.time()
    if not (export / "cfg.json").exists():
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        log = out / "logs" / f"{p.key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            done = subprocess.run(train_argv(p, run_dir, data_root), stdout=f, stderr=subprocess.STDOUT,
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            return {"key": p.key, "error": f"training exited {done.returncode}; see {log}"}
    s = p.shape
    rows, planted = heldout_for(s, data_root)
    ev = evaluate_sae(load_sae(export), [rows[i:i + 4096] for i in range(0, len(rows), 4096)], planted)
    resolved = TrainConfig(d_in=s.d_in, d_sae=s.d_sae, k=s.k, batch_size=s.batch, steps=s.steps, lr=p.lr,
                           lr_warmup_steps=p.warmup, lr_decay_fraction=p.decay,
                           dead_after_samples=p.dead_after).resolved(world_size=1)
    return {"key": p.key, "shape": p.shape.name, "tag": p.tag, "lr": p.lr, "warmup": p.warmup, "decay": p.decay,
            "dead_after": p.dead_after, "seconds": round(time.time() - started, 1),
            "resolved": {k: getattr(resolved, k) for k in ("lr", "lr_warmup_steps", "lr_decay_fraction",
                                                           "dead_after_samples")},
            **{k: v for k, v in ev.to_dict().items() if k in ("fvu", "l0", "dead_fraction", "dense_fraction",
                                                             "recovery")}}


def load_results(out: Path) -> dict[str, dict]:
    path = out / "results.jsonl"
    if not path.exists():
        return {}
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines()) if "error" not in r}


def record(out: Path, result: dict) -> None:
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    rec = result.get("recovery") or {}
    print(f"{result['key']:<34} fvu {result.get('fvu', float('nan')):.4f}  dead {result.get('dead_fraction', 0):.1%}"
          f"  recovered {rec.get('frac_above_0_9', float('nan')):.1%}  ({result.get('seconds', 0):.0f} s)"
          if "error" not in result else f"{result['key']}: {result['error']}", flush=True)


def sweep_shape(s: Shape, out: Path, data_root: Path, done: dict[str, dict], widen: int,
                lrs: list[float] | None = None) -> float:
    """Best lr of the shape by held-out FVU, widening the grid past a best end (at most `widen` times).
    The grid starts at the default rule's lr x 1/2, 1, 2, or at `lrs` (then with the shape's points
    already measured)."""
    if lrs:
        grid = sorted({*lrs, *(r["lr"] for r in done.values() if r.get("shape") == s.name and r.get("tag") == "lr")})
    else:
        guess = default_lr(s.batch, s.d_sae, s.k, s.d_in)
        grid = [guess / 2, guess, guess * 2]
    for _ in range(widen + 1):
        for lr in grid:
            p = Point(s, _round_lr(lr))
            if p.key not in done:
                done[p.key] = run_point(p, out, data_root)
                record(out, done[p.key])
        scored = sorted((done[Point(s, _round_lr(lr)).key].get("fvu", math.inf), lr) for lr in grid)
        best = scored[0][1]
        if best == min(grid):
            grid = [best / 2, *grid]
        elif best == max(grid):
            grid = [*grid, best * 2]
        else:
            return best
    return best


def _round_lr(lr: float) -> float:
    return float(f"{lr:.3g}")


def ablations(s: Shape, best_lr: float) -> list[Point]:
    """At the shape's best lr: a constant lr (no warm-up, no decay), and AuxK never acting (the old
    10M-sample window, longer than these runs)."""
    lr = _round_lr(best_lr)
    return [Point(s, lr, warmup=0, decay=0.0, tag="constant lr"),
            Point(s, lr, dead_after=10_000_000, tag="AuxK window 10M")]


def print_table(done: dict[str, dict]) -> None:
    print(f"{'point':<34} {'tag':<16} {'fvu':>7} {'dead':>6} {'rec>.9':>7} {'rare>.9':>8}")
    for r in done.values():
        rec = r.get("recovery") or {}
        frac = lambda v: f"{v:.1%}" if v is not None else "—"  # noqa: E731
        print(f"{r['key']:<34} {r['tag']:<16} {r['fvu']:7.4f} {r['dead_fraction']:6.1%} "
              f"{frac(rec.get('frac_above_0_9')):>7} {frac(rec.get('rare_frac_above_0_9')):>8}")


def best_lr(results: list[dict]) -> tuple[float, float] | None:
    """(best grid lr, the optimum of a parabola through log2(lr) -> FVU at the best and its two
    neighbours) from one shape's lr points; the grid value twice when the best is at an end."""
    pts = sorted((r["lr"], r["fvu"]) for r in results if r.get("fvu") is not None)
    if not pts:
        return None
    i = min(range(len(pts)), key=lambda j: pts[j][1])
    if i in (0, len(pts) - 1):
        return pts[i][0], pts[i][0]
    (x0, y0), (x1, y1), (x2, y2) = [(math.log2(lr), f) for lr, f in pts[i - 1:i + 2]]
    # Vertex of the parabola through the three points (x steps need not be equal).
    den = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / den
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / den
    vertex = -b / (2 * a) if a > 0 else x1
    return pts[i][0], 2 ** min(max(vertex, x0), x2)


def fit_rule(done: dict[str, dict]) -> None:
    """Least squares of log(best lr) on log(d_in), log(batch), log(d_sae), log(k): which terms the
    sweep supports (residuals printed for each candidate rule)."""
    shapes = {s.name: s for s in SHAPES}
    rows = []
    print(f"{'shape':<5} {'arch':<9} {'d_in':>5} {'d_sae':>6} {'k':>4} {'batch':>5} {'samples':>8} "
          f"{'best grid lr':>12} {'interp. lr':>10} {'rule lr':>8} {'fvu at best':>11}")
    for name, s in shapes.items():
        lr_points = [r for r in done.values() if r.get("shape") == name and r.get("tag") == "lr"]
        found = best_lr(lr_points)
        if found is None:
            continue
        grid, interp = found
        fvu = min(r["fvu"] for r in lr_points if r.get("fvu") is not None)
        rule = default_lr(s.batch, s.d_sae, s.k, s.d_in)
        print(f"{name:<5} {s.architecture:<9} {s.d_in:>5} {s.d_sae:>6} {s.k:>4} {s.batch:>5} {s.samples:>8} "
              f"{grid:>12.3g} {interp:>10.3g} {rule:>8.3g} {fvu:>11.4f}")
        if s.architecture == "topk":
            rows.append((s, interp))
    if len(rows) < 3:
        return
    y = torch.tensor([math.log(lr) for _, lr in rows], dtype=torch.float64)
    terms = {name: (lambda s, name=name: math.log(getattr(s, name) / REFERENCE[name])) for name in REFERENCE}
    for chosen in (["d_in"], ["d_in", "batch"], ["d_in", "d_sae"], ["d_in", "k"], list(terms)):
        if len(chosen) + 1 >= len(rows):
            continue
        X = torch.tensor([[1.0, *[terms[t](s) for t in chosen]] for s, _ in rows], dtype=torch.float64)
        coef = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.squeeze(1)
        rms = float(((X @ coef - y) ** 2).mean().sqrt())
        factors = "".join(f" x ({t}/{REFERENCE[t]})^{float(c):+.2f}" for t, c in zip(chosen, coef[1:]))
        print(f"rule lr = {math.exp(coef[0]):.3g}{factors}   residual rms {rms:.2f} in log lr (x{math.exp(rms):.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--data", type=Path, default=None, help="where harvested shard sets are (default OUT/data)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument("--ablate", default="p1,m1", help="shapes whose best lr gets the ablations")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--widen", type=int, default=3, help="times a grid may grow past a best end")
    ap.add_argument("--lrs", help="the lr grid to start from (comma-separated), instead of the rule's guess")
    ap.add_argument("--table", action="store_true", help="print the table of finished points and the fit, and stop")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data_root = args.data or args.out / "data"
    done = load_results(args.out)
    if args.table:
        print_table(done)
        fit_rule(done)
        return 0
    wanted = args.shapes.split(",")
    for s in SHAPES:
        if s.name not in wanted:
            continue
        if s.shards and not (data_root / s.shards / "manifest.json").exists():
            print(f"{s.name}: skipped, no shards at {data_root / s.shards}", flush=True)
            continue
        best = sweep_shape(s, args.out, data_root, done, args.widen,
                           [float(v) for v in args.lrs.split(",")] if args.lrs else None)
        print(f"== {s.name}: best lr {best:.3g} (default rule says {default_lr(s.batch, s.d_sae, s.k, s.d_in):.3g})",
              flush=True)
        if not args.no_ablations and s.name in args.ablate.split(","):
            for p in ablations(s, best):
                if p.key not in done:
                    done[p.key] = run_point(p, args.out, data_root)
                    record(args.out, done[p.key])
    print_table(done)
    fit_rule(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())

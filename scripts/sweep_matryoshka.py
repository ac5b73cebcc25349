"""Matryoshka's settings on planted hierarchies: what recovers the parents, at what budget.

Each point trains one SAE with the real trainer (`python -m sae_dist train --no-db`, one device)
on the synthetic source with one of bench_quality's hierarchical sets (h1, h2, h3: the same planted
data `make-planted` writes for it), and reads the evaluation the run ends with (rows after its
last sample): FVU, MCC, parents recovered at cos > 0.9, children at > 0.8, dead latents. Points
run `--parallel` at a time (a GPU is far from full with one of these shapes), in the order of
their groups, and no point starts after `--budget` seconds, so the sweep fits a device lease.

    .venv/bin/python scripts/sweep_matryoshka.py --out /tmp/msweep --device cpu --groups budget
    python3 scripts/sweep_matryoshka.py --out $OUT/msweep --device cuda --parallel 6 --budget 300
    .venv/bin/python scripts/sweep_matryoshka.py --out /tmp/msweep --table   # what is done
    .venv/bin/python scripts/sweep_matryoshka.py --out /tmp/msweep --truth   # the truth's own FVU, two ways

Groups: budget (TopK and the default at 1x, 4x, 8x, 16x one pass), widths, lr, auxk, weight (the
inner prefixes' loss weight), select, seed, alone (h3: h1 whose parents fire alone 30% of the time),
h2, refit (the decoder refit, `--refit-fraction`, on h1-h3), reread (runs with and
without the refit that scripts/refit_offline.py reads again), rare (the rare-latent bias against
none at 4x and 8x on h1, 4x on h2 and h3), rare-more (the bias at 16x on h1, seeds 1 and 2 at
1x), unseen (TopK and Matryoshka with and without the bias on two hierarchies, u1 and u2, that no
default was tuned on), u2-alone (u2 with its parents firing alone 5% and 15% of the time), u2-shape (u2 at 15% alone
with four children a parent, magnitude sigma 0.6, or 6 features active, as u1 has; at 30%; and
u2 itself, never alone, with four children, sigma 0.6, or both, beside TopK; h1 at sigma 0.6),
u2-absorb (u2 with an inner prefix of d_sae/8, five prefixes, k 30, batch selection, four passes),
floor (the rare-latent bias's floor at 0.2 and 0.4 on h1, seeds 0-2), floor2 (0.4 on u1, u2, h2 and
h3 at seed 1; 0.2 and 0.4 on the flat sets q1-q3), floor3 (0.6 and 0.8 on h1 at seed 0, 0.6 at
seed 1; 0.4 on h2 and h3 at seed 0; the bias stopped at 0.5 and 0.85 of the steps on h1), declr
(the decoder's lr at 1x-4x), ioff (the inner prefixes' offset on and off on every set), ioffw
(the inner weight at 2-16 with the offset, on u2, h1, h2, h3 and u1; u2 at 4 and seed 1), isched (the
inner weight's schedule against a constant weight on every set, and falling to 0.25 on h1 and u2), istart
(the schedule starting at 16 on h1 and u2, at 32 on u2).
Results append to OUT/results.jsonl; a rerun skips the points already there. A Matryoshka
point runs with the trainer's defaults, which since 2026-11-29 refit the decoder over the last
fifth of the steps: the figures measured before ran without it (`refit_fraction=0` repeats them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_quality import ALL_SETS, SETS  # noqa: E402
from sae_dist.contract import stored_train_argv  # noqa: E402

STEPS = 1024  # one pass over bench_quality's 1,048,576 rows at batch 1024
SET = {s.name: s for s in ALL_SETS}
# u2 with its parents also firing alone (a child with 95% or 85% of their firings): is firing alone
# what separates the shapes whose parents the defaults recover from those they miss?
SET.update({f"u2-alone{a}": replace(SET["u2"], name=f"u2-alone{a}", child_prob=1 - a / 100) for a in (5, 15, 30)})
# u2 at 15% alone with one of its differences from u1 (which recovers every parent) taken from u1:
# four children a parent, wider magnitudes, fewer features active in a row (k kept at twice that);
# and u2 itself (parents never alone) with the first two, apart and together
SHAPE = {"c4": {"children": 4}, "s6": {"magnitude_sigma": 0.6}, "a6": {"active": 6, "k": 12}}
SET.update({f"u2-alone15-{name}": replace(SET["u2-alone15"], name=f"u2-alone15-{name}", **change)
            for name, change in SHAPE.items()})
SET.update({f"u2-{name}": replace(SET["u2"], name=f"u2-{name}", **change)
            for name, change in (("c4", SHAPE["c4"]), ("s6", SHAPE["s6"]), ("c4s6", {**SHAPE["c4"], **SHAPE["s6"]}))})
SET["h1-s6"] = replace(SET["h1"], name="h1-s6", **SHAPE["s6"])


@dataclass(frozen=True)
class Point:
    group: str
    name: str
    data: str = "h1"
    flags: dict = field(default_factory=dict)
    passes: int = 1
    seed: int = 0

    @property
    def key(self) -> str:
        return f"{self.data}/{self.name}"


def mat(**flags) -> dict:
    return {"architecture": "matryoshka", **flags}


POINTS = [
    Point("budget", "topk"), Point("budget", "matryoshka", flags=mat()),
    Point("budget", "topk-4x", passes=4), Point("budget", "matryoshka-4x", flags=mat(), passes=4),
    Point("budget", "matryoshka-8x", flags=mat(), passes=8),
    Point("budget", "matryoshka-16x", flags=mat(), passes=16), Point("budget", "topk-16x", passes=16),
    *[Point("widths", f"w{w.replace(',', '-')}", flags=mat(matryoshka_widths=w))
      for w in ("512,4096", "256,1024,4096", "512,1024,4096", "512,2048,4096", "1024,2048,4096", "2048,4096",
                "128,512,4096", "256,512,1024,2048,4096", "512,1024,2048,4096")],
    Point("widths", "w512-4096-4x", flags=mat(matryoshka_widths="512,4096"), passes=4),
    *[Point("lr", f"lr{lr}", flags=mat(lr=lr)) for lr in ("1.8e-3", "7.2e-3", "1.44e-2")],
    *[Point("auxk", f"auxk{c}", flags=mat(auxk_coefficient=c)) for c in ("0", "0.125")],
    *[Point("weight", f"iw{w}", flags=mat(matryoshka_inner_weight=w)) for w in ("0.25", "0.5", "2", "4")],
    Point("select", "batch", flags=mat(matryoshka_selection="batch")),
    Point("select", "batch-4x", flags=mat(matryoshka_selection="batch"), passes=4),
    *[Point("seed", f"matryoshka-seed{s}", flags=mat(), seed=s) for s in (1, 2)],
    *[Point("seed", f"topk-seed{s}", seed=s) for s in (1, 2)],
    # h3, h1 whose parents fire alone 30% of the time: hedging is then not the inner prefix's optimum
    Point("alone", "topk", data="h3"), Point("alone", "matryoshka", data="h3", flags=mat()),
    Point("h2", "topk", data="h2"), Point("h2", "matryoshka", data="h2", flags=mat()),
    Point("h2", "matryoshka-4x", data="h2", flags=mat(), passes=4),
    # the decoder refit to the codes of the last fifth (the lr decay's) and half of the steps
    *[Point("refit", f"{name}-refit{f}", data=d, flags={**flags, "refit_fraction": f})
      for d in ("h1", "h2", "h3") for name, flags in (("matryoshka", mat()), ("topk", {})) for f in (0.2, 0.5)],
    # (the baselines say refit_fraction=0: the refit is Matryoshka's default since 2026-11-29)
    Point("refit", "matryoshka", data="q1", flags=mat(refit_fraction=0)),  # flat features
    Point("refit", "matryoshka-refit0.2", data="q1", flags=mat(refit_fraction=0.2)),
    Point("refit", "matryoshka-seed1", data="h2", flags=mat(refit_fraction=0), seed=1),  # h2 at a second seed
    Point("refit", "matryoshka-refit0.5-seed1", data="h2", flags=mat(refit_fraction=0.5), seed=1),
    # runs for scripts/refit_offline.py (a second read of the last rows): h1-h3 with the default
    # (the refit) and without the refit
    *[Point("reread", name, data=d, flags=mat(**flags)) for d in ("h1", "h2", "h3")
      for name, flags in (("matryoshka", {}), ("matryoshka-refit0", {"refit_fraction": 0}))],
    # the rare-latent bias (the default since 2026-11-29) against none, with more rows: the longest first
    *[Point("rare", f"bias{suffix}-{n}x", data="h1", flags=mat(**flags), passes=n)
      for n in (8, 4) for suffix, flags in (("", {}), ("0", {"rare_bias_floor": 0}))],
    *[Point("rare", "bias-4x", data=d, flags=mat(), passes=4) for d in ("h2", "h3")],
    *[Point("rare", "bias-1x", data=d, flags=mat()) for d in ("h1", "h2", "h3")],
    *[Point("unseen", name, data=d, flags=flags) for d in ("u1", "u2")
      for name, flags in (("topk", {}), ("matryoshka", mat()), ("matryoshka-rare0", mat(rare_bias_floor=0)))],
    Point("rare-more", "bias-16x", data="h1", flags=mat(), passes=16),
    *[Point("rare-more", f"bias-1x-seed{s}", data=d, flags=mat(), seed=s) for s in (1, 2) for d in ("h1", "h2", "h3")],
    *[Point("u2-alone", "matryoshka", data=f"u2-alone{a}", flags=mat()) for a in (5, 15)],
    *[Point("u2-shape", "matryoshka", data=d, flags=mat())
      for d in ("u2-alone15-s6", "u2-alone15-c4", "u2-alone15-a6", "u2-alone30")],
    *[Point("u2-shape", name, data=f"u2-{d}", flags=flags) for d in ("c4", "s6", "c4s6")
      for name, flags in (("matryoshka", mat()), ("topk", {}))],
    Point("u2-shape", "matryoshka", data="h1-s6", flags=mat()),  # h1 (never alone, 3 children) at sigma 0.6
    # u2's absorption against prefix layouts, room in k, batch selection and more rows
    *[Point("u2-absorb", f"matryoshka-{name}", data="u2", flags=mat(**flags), passes=passes)
      for name, flags, passes in (("w640", {"matryoshka_widths": "640,5120"}, 1),
                                  ("w5", {"matryoshka_widths": "320,640,1280,2560,5120"}, 1),
                                  ("k30", {"k": 30}, 1), ("batch", {"matryoshka_selection": "batch"}, 1),
                                  ("4x", {}, 4))],
    # the rare-latent bias's floor at 0.4 against the default 0.2: h1 over three seeds, then the
    # other hierarchies and the flat sets
    *[Point("floor", f"floor{f}-seed{s}", data="h1", flags=mat(rare_bias_floor=f), seed=s)
      for f in ("0.2", "0.4") for s in (0, 1, 2)],
    *[Point("floor2", f"floor0.4-seed{s}", data=d, flags=mat(rare_bias_floor="0.4"), seed=s)
      for d, s in (("u1", 0), ("u2", 0), ("h2", 1), ("h3", 1))],
    *[Point("floor2", f"floor{f}", data=d, flags=mat(rare_bias_floor=f)) for d in ("q1", "q2", "q3")
      for f in ("0.2", "0.4")],
    # higher floors still: 0.6 and 0.8 on h1 (seed 0; 0.6 at seed 1 too), then the 0.4 default's
    # seed-0 points on h2 and h3
    *[Point("floor3", f"floor{f}-seed0", data="h1", flags=mat(rare_bias_floor=f)) for f in ("0.6", "0.8")],
    Point("floor3", "floor0.6-seed1", data="h1", flags=mat(rare_bias_floor="0.6"), seed=1),
    *[Point("floor3", "floor0.4-seed0", data=d, flags=mat(rare_bias_floor="0.4")) for d in ("h2", "h3")],
    *[Point("floor3", f"until{u}-seed0", data="h1", flags=mat(rare_bias_until=u)) for u in ("0.5", "0.85")],
    # the decoder's lr apart (the default 3x since 2026-11-30): 1x is the floor3 points' default before
    *[Point("declr", f"declr{f}", data="h1", flags=mat(decoder_lr_factor=f)) for f in ("1", "2", "3", "4")],
    Point("declr", "declr3-seed1", data="h1", flags=mat(decoder_lr_factor="3"), seed=1),
    *[Point("declr", f"declr{f}", data=d, flags=mat(decoder_lr_factor=f))
      for d in ("h2", "h3", "u1", "u2", "q1", "q2", "q3") for f in ("1", "3")],
    Point("declr", "declr2", data="h3", flags=mat(decoder_lr_factor="2")),
    # the inner prefixes' offset (on by default since 2026-11-30): each set's point with it on and
    # off (off: the default until then), and h1 at seed 1
    # (their inner weight constant, as it was before its schedule: matryoshka_inner_weight_start at the weight)
    *[Point("ioff", f"ioff{int(on)}", data=d, flags=mat(matryoshka_inner_offset=on, matryoshka_inner_weight_start="1"))
      for d in ("h1", "h2", "h3", "u1", "u2", "q1", "q2", "q3") for on in (True, False)],
    *[Point("ioff", f"ioff{int(on)}-seed1", data="h1", seed=1,
            flags=mat(matryoshka_inner_offset=on, matryoshka_inner_weight_start="1"))
      for on in (True, False)],
    # the inner weight with the offset on (the default weight 1 is the ioff group's ioff1)
    *[Point("ioffw", f"ioffw{w}", data=d, flags=mat(matryoshka_inner_weight=w, matryoshka_inner_weight_start=w))
      for d, weights in (("u2", ("2", "4", "6", "8", "16")), ("h1", ("2", "4", "8")), ("h2", ("2",)),
                         ("h3", ("4",)), ("u1", ("4",)))
      for w in weights],
    Point("ioffw", "ioffw4-seed1", data="u2", seed=1,
          flags=mat(matryoshka_inner_weight="4", matryoshka_inner_weight_start="4")),
    # the inner weight's schedule (the default since 2026-12-01: 8, held for 30% of the steps, 1 by
    # 60%) against the constant weight 1 (the default until then) on every set, and its variants
    *[Point("isched", f"iws{w}", data=d,
            flags=mat(matryoshka_inner_weight_start=w, matryoshka_inner_weight_until="0.6"))
      for d in ("h1", "h2", "h3", "u1", "u2", "q1", "q2", "q3") for w in ("1", "8")],
    *[Point("isched", f"iws8-iw{w}", data=d, flags=mat(matryoshka_inner_weight_start="8", matryoshka_inner_weight=w,
                                                        matryoshka_inner_weight_until="0.6"))
      for d in ("h1", "u2") for w in ("0.25",)],
    # a stronger start of the schedule (2026-12-01, twenty-fifth session): 16 on h1 and u2, 32 on u2
    *[Point("istart", f"iws{w}", data=d, flags=mat(matryoshka_inner_weight_start=w))
      for d, w in (("h1", "16"), ("u2", "16"), ("u2", "32"))],
]
GROUPS = list(dict.fromkeys(p.group for p in POINTS))


def argv(point: Point, out: Path, device: str) -> list[str]:
    s = SET[point.data]
    args = {"source": "synthetic", "d_in": s.d_in, "synthetic_features": s.features, "synthetic_active": s.active,
            "synthetic_power_law": s.power_law, "synthetic_children": s.children,
            "synthetic_child_prob": s.child_prob, "synthetic_magnitude_sigma": s.magnitude_sigma,
            "d_sae": s.d_sae, "k": s.k, "batch_size": 1024, "steps": STEPS * point.passes, "seed": point.seed,
            "checkpoint_every": 0, "log_every": 256, "out_dir": str(out), **point.flags}
    # the flags as a queued job's (booleans as --x / --no-x, defaults left out); the CLI validates them
    return [sys.executable, "-m", "sae_dist", "train", "--no-db", *stored_train_argv(args, f"{device}:1")]


def run_point(point: Point, out: Path, device: str, threads: int = 1) -> dict:
    run_dir = out / "runs" / point.data / point.name
    log = out / "logs" / f"{point.data}-{point.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(argv(point, run_dir, device), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))})
    row = {"key": point.key, "group": point.group, "data": point.data, "name": point.name, "passes": point.passes,
           "seed": point.seed, "flags": point.flags, "device": device, "seconds": round(time.monotonic() - started, 1)}
    if done.returncode != 0:
        return {**row, "error": f"exit {done.returncode}: {log.read_text(errors='replace')[-300:]}"}
    ev = json.loads((run_dir / "evaluation.json").read_text())
    rec = ev.get("recovery") or {}
    return {**row, "fvu": ev["fvu"], "l0": ev["l0"], "dead": ev["dead_fraction"], "mcc": rec.get("mcc"),
            "recovered": rec.get("frac_above_0_9"), "parents": rec.get("parents_frac_above_0_9"),
            "children": rec.get("children_frac_above_0_8"), "absorbed": rec.get("absorbed_parents"),
            "in_a_childs_latent": rec.get("parents_in_a_childs_latent"),
            "children_in_parents": rec.get("children_in_parents"), "uniqueness": rec.get("uniqueness"),
            "latents_on_a_feature": rec.get("latents_on_a_feature"), "firings_mixed": rec.get("firings_mixed")}


def planted_source(data: str):
    from sae_dist.config import TrainConfig
    from sae_dist.data.sources.synthetic import SyntheticSource

    s = SET[data]
    return SyntheticSource(d_in=s.d_in, n_features=s.features, active=s.active, power_law=s.power_law,
                           noise=TrainConfig().synthetic_noise, seed=0, rank=0, world_size=1, batch_size=1,
                           children=s.children, child_prob=s.child_prob, magnitude_sigma=s.magnitude_sigma)


def truth_fvu(data: str, rows: int = 16384) -> float:
    """FVU of the planted truth itself, kept to each row's k largest features (the SAE's budget),
    on the rows after one pass: an oracle's codes, which no encoder of one layer computes."""
    import torch

    from sae_dist.evaluate.metrics import fvu

    source, k = planted_source(data), SET[data].k
    x, codes = source.samples(STEPS * 1024, rows), source.codes(STEPS * 1024, rows)
    keep = torch.zeros_like(codes).scatter_(1, codes.abs().topk(k, dim=1).indices, 1.0)
    return fvu(x, (codes * keep) @ source.dictionary)


def truth_sae_fvu(data: str, steps: int, start_only: bool = False, rows: int = 16384, lr: float = 1e-3) -> float:
    """FVU, on the same rows, of our TopK SAE given the planted dictionary as its decoder, its
    encoder trained for `steps` batches of fresh rows (Adam, cosine decay). Held fixed (the
    default), the decoder recovers every feature by construction: what an SAE with exactly the truth
    reaches with its k. With `start_only`, the SAE has the set's own d_sae, the truth is only where
    its decoder starts (the other rows random), and everything trains: what the benchmark's SAE
    would reach had it begun at the answer."""
    import torch

    from sae_dist.evaluate.metrics import fvu
    from sae_dist.models.sae import SparseAutoencoder

    source, s = planted_source(data), SET[data]
    truth = torch.nn.functional.normalize(source.dictionary.float(), dim=1)
    sae = SparseAutoencoder(s.d_in, s.d_sae if start_only else truth.shape[0], "topk", k=s.k, seed=0)
    with torch.no_grad():
        sae.W_dec[:truth.shape[0]].copy_(truth)
        sae.W_enc.copy_(sae.W_dec.t())
    sae.W_dec.requires_grad_(start_only)
    opt = torch.optim.Adam([p for p in sae.parameters() if p.requires_grad], lr=lr)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    start = STEPS * 1024 + rows  # fresh rows after the judged ones
    for step in range(steps):
        x = source.samples(start + step * 1024, 1024)
        loss = (sae.decode(sae.encode(x)) - x).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
        if start_only:
            sae.normalize_decoder()
    x = source.samples(STEPS * 1024, rows)
    with torch.no_grad():
        return fvu(x, sae.decode(sae.encode(x)))


def table(results: list[dict]) -> str:
    lines = ["| data | point | passes | FVU | MCC | parents > 0.9 | children > 0.8 | dead | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['data']} | {r['name']} | {r['passes']} | error: {r['error'][:60]} |||||")
            continue
        lines.append(f"| {r['data']} | {r['name']} | {r['passes']} | {r['fvu']:.3f} | {r['mcc']:.3f} | "
                     f"{_share(r['parents'])} | {_share(r['children'])} | {r['dead']:.1%} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def _share(value: float | None) -> str:
    """A share as a percentage; "—" where the set has none (a flat set has no parents)."""
    return "—" if value is None else f"{value:.1%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--budget", type=float, default=float("inf"), help="no point starts after this many seconds")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    p.add_argument("--table", action="store_true", help="print the table of what is done, run nothing")
    p.add_argument("--truth", action="store_true", help="print the planted truth's FVU at each set's k, run nothing")
    p.add_argument("--truth-steps", type=int, default=4096, help="--truth: batches that train the truth's encoder")
    ns = p.parse_args()
    for flag, value in (("--parallel", ns.parallel), ("--truth-steps", ns.truth_steps)):
        if value < 1:
            raise SystemExit(f"sweep_matryoshka: {flag} must be 1 or more, got {value}")
    wanted = ns.groups.split(",")
    if unknown := set(wanted) - set(GROUPS):
        raise SystemExit(f"sweep_matryoshka: unknown group(s) {', '.join(sorted(unknown))}; "
                         f"the groups are {', '.join(GROUPS)}")
    results_path = ns.out / "results.jsonl"
    ns.out.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in results_path.read_text().splitlines()] if results_path.exists() else []
    if ns.truth:
        for data in (s.name for s in SETS if s.children):
            print(f"{data}: the truth's FVU, each row's {SET[data].k} largest features: {truth_fvu(data):.4f}; "
                  f"a TopK SAE whose decoder is the truth, its encoder trained on {ns.truth_steps} batches: "
                  f"{truth_sae_fvu(data, ns.truth_steps):.4f}; the benchmark's SAE started at the truth, "
                  f"one pass: {truth_sae_fvu(data, STEPS, start_only=True):.4f}", flush=True)
        return 0
    if ns.table:
        print(table(done))
        return 0
    seen = {r["key"] for r in done if "error" not in r}
    todo = [pt for g in wanted for pt in POINTS if pt.group == g and pt.key not in seen]
    # The cores shared out: spinning OpenMP threads of runs side by side that oversubscribe the
    # cores made each several times slower (docs/testing.md saw the same in the tests).
    threads = max(1, (os.cpu_count() or 1) // ns.parallel)
    deadline = time.monotonic() + ns.budget
    with ThreadPoolExecutor(ns.parallel) as pool, results_path.open("a") as results:
        running = set()
        while todo or running:
            while todo and len(running) < ns.parallel and time.monotonic() < deadline:
                running.add(pool.submit(run_point, todo.pop(0), ns.out, ns.device, threads))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                row = f.result()
                results.write(json.dumps(row) + "\n")
                results.flush()
                done.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    if todo:
        print(f"not started (budget spent): {', '.join(pt.key for pt in todo)}")
    print(table(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())

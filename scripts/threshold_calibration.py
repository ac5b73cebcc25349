"""What a BatchTopK SAE's (or transcoder's) learned threshold costs: its held-out FVU and L0 as
exported, and with the one threshold that gives L0 = k on rows it trained on.

BatchTopK keeps the k x batch largest pre-activations of a batch while training; at inference,
with no batch, SAELens (and our export) use one threshold, a running mean of the smallest kept
value. On a short run that mean lags the encoder, and the exported L0 can end below k. This
script asks whether that matters: it sets the threshold to the (k x rows)-th largest positive
pre-activation over the first --fit-rows rows of the shards (rows the SAE trained on), and
judges both thresholds with `evaluate`'s own metrics on its held-out tail.

    .venv/bin/python scripts/threshold_calibration.py RUN_DIR/sae SHARDS --k 32 [--fit-rows 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from sae_dist.data.shard_format import read_layout
from sae_dist.evaluate.data import heldout_rows
from sae_dist.evaluate.load import load_sae
from sae_dist.evaluate.metrics import evaluate_sae


def first_rows(shards: str, rows: int) -> torch.Tensor:
    """The first `rows` rows of the shards (the start of what a run trains on)."""
    from safetensors import safe_open

    out, need = [], rows
    for path in read_layout(shards).files:
        with safe_open(str(path), "pt") as f:
            t = f.get_tensor(next(iter(f.keys())))
        out.append(t[:need].float())
        need -= out[-1].shape[0]
        if need <= 0:
            break
    return torch.cat(out)


def calibrated_threshold(sae, rows: torch.Tensor, k: float) -> float:
    """The threshold at which the SAE's mean L0 over `rows` is k (pure but for the encode)."""
    open_sae = dataclasses.replace(sae, threshold=torch.zeros_like(sae.threshold))
    x = rows[:, :sae.d_in]  # a transcoder encodes its input half
    acts = open_sae.encode(x).flatten()
    positive = acts[acts > 0]
    return float(positive.topk(max(1, min(round(k * x.shape[0]), positive.numel()))).values.min())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sae")
    ap.add_argument("shards")
    ap.add_argument("--k", type=int, required=True, help="the k it was trained with")
    ap.add_argument("--fit-rows", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=16384, help="held-out rows (the tail, as evaluate)")
    args = ap.parse_args()
    sae = load_sae(args.sae)
    if sae.architecture != "jumprelu":
        raise SystemExit(f"{args.sae} is {sae.architecture}, not a JumpReLU export: it has no threshold to calibrate")
    held = heldout_rows(args.shards, args.rows)
    fitted = calibrated_threshold(sae, first_rows(args.shards, args.fit_rows), args.k)
    print(f"{args.sae}: exported threshold mean {float(sae.threshold.mean()):.4f}; "
          f"calibrated to L0 = {args.k} on the first {args.fit_rows} rows: {fitted:.4f}")
    for label, threshold in (("exported", sae.threshold), ("calibrated", torch.full_like(sae.threshold, fitted))):
        ev = evaluate_sae(dataclasses.replace(sae, threshold=threshold), [held])
        print(f"  {label:10s}: held-out FVU {ev.fvu:.4f}, L0 {ev.l0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

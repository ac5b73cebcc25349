"""What a second read of a run's last rows would buy: the decoder refit with the final encoder's
codes, and the encoder trained again with the decoder frozen. Offline, on a one-pass run of
`sweep_matryoshka.py` (the synthetic stream of one of bench_quality's sets, which can be read again
at any row); the trainer reads each row once and does neither.

    .venv/bin/python scripts/refit_offline.py RUN_DIR --data h2 --refit          # fresh codes, last fifth
    .venv/bin/python scripts/refit_offline.py RUN_DIR --data h2 --refit --every 4  # a quarter of those rows
    .venv/bin/python scripts/refit_offline.py RUN_DIR --data h3 --encoder-lr 1e-3  # the encoder, again

RUN_DIR is a point's run folder (OUT/runs/SET/NAME, with sae/ in it). Each stage prints the FVU,
MCC, parents and children of the SAE on the 16,384 rows after the run's last, as the run's own
evaluation does. One thread, as the sweep's points.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import sweep_matryoshka as sm  # noqa: E402
from sae_dist.config import TrainConfig  # noqa: E402
from sae_dist.evaluate.load import LoadedSae, load_sae  # noqa: E402
from sae_dist.evaluate.metrics import evaluate_sae  # noqa: E402
from sae_dist.evaluate.planted import planted_from_settings  # noqa: E402
from sae_dist.models.refit import DecoderRefit  # noqa: E402
from sae_dist.models.sparse_ops import Pattern  # noqa: E402

BLOCK = 4096  # rows a forward


def report(tag: str, sae: LoadedSae, source, rows: int, planted) -> None:
    e = evaluate_sae(sae, source.samples(rows, 16384).split(BLOCK), planted)
    r = e.recovery
    print(f"{tag}: FVU {e.fvu:.4f}, MCC {r.mcc:.3f}, parents {r.parents_frac_above_0_9:.1%}, "
          f"children {r.children_frac_above_0_8:.1%}", flush=True)


@torch.no_grad()
def refit_fresh(sae: LoadedSae, source, first: int, last: int, every: int) -> None:
    """The trainer's refit (its sums and solve) on the final encoder's codes of rows [first,
    last), every `every`-th block of them."""
    d_sae, d_in = sae.W_dec.shape
    refit = DecoderRefit(d_sae, d_in, "cpu")
    for start in range(first, last, BLOCK * every):
        x = source.samples(start, min(BLOCK, last - start))
        vals, idx = sae.encode(x).topk(sae.k, dim=1)
        goal = x - sae.b_dec
        if refit.scales is None:
            refit.set_scales(vals, goal)
        refit.add(Pattern.per_row(idx, d_sae), vals.reshape(-1), goal)
    sae.W_dec = refit.solve(sae.W_dec)


def train_encoder(sae: LoadedSae, source, first: int, last: int, lr: float, batch: int = 1024) -> None:
    """Adam on the encoder alone over rows [first, last) again, the decoder frozen: the whole
    dictionary's squared error, the lr constant for the first half and then decayed to 0."""
    w, b = sae.W_enc.clone().requires_grad_(), sae.b_enc.clone().requires_grad_()
    opt = torch.optim.Adam([w, b], lr=lr)
    steps = (last - first) // batch
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (steps - step) / (0.5 * steps))
        x = source.samples(first + step * batch, batch)
        pre = (x - sae.b_dec) @ w + b
        vals, idx = pre.topk(sae.k, dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        loss = (acts @ sae.W_dec + sae.b_dec - x).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sae.W_enc, sae.b_enc = w.detach(), b.detach()


def check(ns: argparse.Namespace) -> None:
    """One line and a failure for each bad option, before any work."""
    if not 0 < ns.window <= 1:
        raise SystemExit(f"refit_offline: --window must be in (0, 1], got {ns.window}")
    if ns.every < 1:
        raise SystemExit(f"refit_offline: --every must be 1 or more, got {ns.every}")
    if ns.encoder_lr is not None and not ns.encoder_lr > 0:
        raise SystemExit(f"refit_offline: --encoder-lr must be above 0, got {ns.encoder_lr}")
    if not (ns.refit or ns.encoder_lr):
        raise SystemExit("refit_offline: nothing to do; ask for --refit, --encoder-lr or both")
    if not (ns.run_dir / "sae" / "cfg.json").is_file():
        raise SystemExit(f"refit_offline: {ns.run_dir} has no SAE (sae/cfg.json); give a sweep point's run folder")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--data", required=True, choices=sorted(s for s in sm.SET if sm.SET[s].children))
    p.add_argument("--window", type=float, default=0.2, help="the last fraction of the run's rows read again")
    p.add_argument("--refit", action="store_true", help="refit the decoder to the final encoder's codes")
    p.add_argument("--every", type=int, default=1, help="the refit reads every N-th block of 4,096 rows")
    p.add_argument("--encoder-lr", type=float, help="then train the encoder alone at this lr")
    ns = p.parse_args()
    check(ns)
    torch.set_num_threads(1)
    s, rows = sm.SET[ns.data], sm.STEPS * 1024
    sae = load_sae(ns.run_dir / "sae")
    if sae.architecture != "topk":
        raise SystemExit(f"refit_offline: {ns.run_dir / 'sae'} is a {sae.architecture} SAE; "
                         "this script reads per-sample TopK ones")
    source = sm.planted_source(ns.data)
    planted = planted_from_settings(s.d_in, s.features, s.active, s.power_law, TrainConfig().synthetic_noise, 0,
                                    children=s.children, child_prob=s.child_prob,
                                    magnitude_sigma=s.magnitude_sigma)
    planted.first_row = rows
    first = rows - round(rows * ns.window)
    report("as trained", sae, source, rows, planted)
    if ns.refit:
        started = time.monotonic()
        refit_fresh(sae, source, first, rows, ns.every)
        report(f"refit to the final encoder's codes ({time.monotonic() - started:.0f} s)", sae, source, rows, planted)
    if ns.encoder_lr:
        started = time.monotonic()
        train_encoder(sae, source, first, rows, ns.encoder_lr)
        report(f"encoder trained again ({time.monotonic() - started:.0f} s)", sae, source, rows, planted)


if __name__ == "__main__":
    main()

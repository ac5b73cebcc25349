"""N SAEs in one sweep job against the same N SAEs as N sequential jobs (issue 20's benchmark).

Same devices, same data (one seeded stream), same steps; each job is the real CLI
(`python -m sae_dist train`, --no-db, no checkpoints but the last, no end-of-run evaluation), timed
from start to exit, so the sequential jobs pay their start-up N times, as they would. Per-SAE
throughput = samples each SAE trained on / the wall time its job(s) took; the ratio is the sweep's
over the sequential jobs'. One table, measured in one run (a loaded machine moves both sides; the
load average is printed beside it).

    .venv/bin/python scripts/bench_sweep.py --n 4 --source shards --steps 100 --devices cpu:1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="SAEs (k = 8, 16, 24, ...)")
    ap.add_argument("--source", choices=("shards", "synthetic"), default="shards")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--d-in", type=int, default=64)
    ap.add_argument("--expansion-factor", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1024, help="per device")
    ap.add_argument("--devices", default="cpu:1")
    args = ap.parse_args()
    ks = [8 * (i + 1) for i in range(args.n)]
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        base = _base_flags(args, Path(tmp))
        sweep_s = _timed([*base, "--sweep", "k=" + ",".join(map(str, ks)), "--out-dir", f"{tmp}/sweep"])
        alone_s = [_timed([*base, "--k", str(k), "--out-dir", f"{tmp}/k{k}"]) for k in ks]
    world = int(args.devices.split(":")[1]) if ":" in args.devices else 1
    samples = args.steps * args.batch_size * world  # per SAE
    seq_s = sum(alone_s)
    print(f"\n{args.n} SAEs (k={ks}), d_in {args.d_in} x{args.expansion_factor}, {args.steps} steps of "
          f"{args.batch_size * world} samples from {args.source} on {args.devices}; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print("| how | wall s (all SAEs) | samples/s per SAE | ratio |")
    print("|---|---|---|---|")
    print(f"| {args.n} sequential jobs | {seq_s:.1f} | {args.n * samples / seq_s:,.0f} | 1.00 |")
    print(f"| one sweep job | {sweep_s:.1f} | {args.n * samples / sweep_s:,.0f} | {seq_s / sweep_s:.2f} |")
    return 0


def _base_flags(args, tmp: Path) -> list[str]:
    flags = ["--d-in", str(args.d_in), "--expansion-factor", str(args.expansion_factor), "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--devices", args.devices, "--no-db", "--eval-rows", "0",
             "--checkpoint-every", "0", "--log-every", str(max(1, args.steps // 2)), "--seed", "0"]
    if args.source == "synthetic":
        return flags
    import torch

    from sae_dist.shard_format import write_shards

    rows = args.steps * args.batch_size * 2 + 1024  # more than one epoch's worth is never needed
    gen = torch.Generator().manual_seed(0)
    write_shards(tmp / "shards", [torch.randn(65536, args.d_in, generator=gen) for _ in range(-(-rows // 65536))])
    return [*flags, "--source", "shards", "--shards-path", str(tmp / "shards")]


def _timed(flags: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sae_dist", "train", *flags], cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(flags)}\n{done.stderr[-2000:]}")
    return took


if __name__ == "__main__":
    sys.exit(main())

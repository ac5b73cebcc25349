"""The memory estimate against real training runs: each configuration trains a few steps on CPU
(`python -m sae_dist train --no-db`), and the trainer's last line, "peak memory: measured X MiB,
estimated Y MiB", is compared. The measured figure is the rank's whole anonymous peak (see
sae_dist.memory.PeakMemory: memory-mapped shard pages are not counted); the estimate includes the
runtime baseline, which this script also measures here, so that the constant can be checked.

On a GPU (--device cuda) the trainer's measured figure is the allocator's peak plus the same
constant for the CUDA context the estimate adds (sae_dist.memory.CUDA_CONTEXT_BYTES); this script
measures the context itself (what the driver says the device uses, less what torch's allocator
holds, after a first training step has loaded the kernels) and compares the estimate with the
allocator's peak plus that measured context.

    .venv/bin/python scripts/bench_memory.py            # the table (a few minutes on 2 cores)
    .venv/bin/python scripts/bench_memory.py --only 1,4  # some rows (numbers from the table)
    python3 scripts/bench_memory.py --device cuda        # three GPU shapes, bf16 as the trainer's default

Exit status 1 when a configuration is outside +-25%.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sae_dist.memory import CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, estimate_memory  # noqa: E402  (torch-free)

TOLERANCE = 0.25
MIB = 2**20
FINAL = re.compile(r"peak memory: measured ([\d.]+) MiB, estimated ([\d.]+) MiB")


@dataclass(frozen=True)
class Config:
    source: str  # synthetic | shards
    d_in: int
    d_sae: int
    batch: int
    architecture: str = "topk"
    k: int = 32
    ranks: int = 1
    steps: int = 6
    extra: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        ranks = f" x{self.ranks} ranks" if self.ranks > 1 else ""
        return (f"{self.architecture} {self.source} d_in {self.d_in} d_sae {self.d_sae} "
                f"batch {self.batch}{ranks}")


CONFIGS = [
    Config("synthetic", 64, 256, 1024, k=16),
    Config("shards", 64, 1024, 1024, k=16),
    Config("synthetic", 128, 4096, 2048),
    Config("shards", 128, 8192, 1024),
    Config("synthetic", 128, 16384, 1024),
    Config("shards", 256, 32768, 1024),
    Config("synthetic", 256, 65536, 512, steps=4),
    Config("synthetic", 128, 16384, 1024, ranks=2),
    Config("synthetic", 128, 16384, 1024, architecture="batchtopk"),
    Config("shards", 128, 4096, 1024, architecture="standard"),
]

# On a GPU: the GPU check's shapes (the trainer's defaults otherwise: precision auto, i.e. bf16).
CUDA_CONFIGS = [
    Config("synthetic", 768, 24576, 4096),
    Config("synthetic", 2048, 32768, 4096),
    Config("synthetic", 4096, 65536, 4096, k=64),
]

# Shards: enough rows that a run's random reads touch far more file pages than its tensors take
# (the pages a measure that counted them would add), in files of 64 MiB.
SHARD_BYTES = 256 * MIB
SHARD_FILE_BYTES = 64 * MIB


def write_shard_dir(directory: Path, d_in: int, total_bytes: int = SHARD_BYTES,
                    file_bytes: int = SHARD_FILE_BYTES, seed: int = 0) -> Path:
    """Gaussian activations [rows, d_in] as shards (written chunk by chunk, never whole in memory)."""
    import torch

    from sae_dist.data.shard_format import write_shards

    rows_per_file = file_bytes // (4 * d_in)
    files = max(1, total_bytes // file_bytes)
    gen = torch.Generator().manual_seed(seed)
    return write_shards(directory, (torch.randn(rows_per_file, d_in, generator=gen) for _ in range(files)))


def measured_runtime() -> int:
    """RssAnon of a fresh process that has imported what a rank imports before its model."""
    code = ("import sae_dist.cli, sae_dist.train.loop, sae_dist.data.sources.shards; "
            "from sae_dist.memory import anonymous_bytes; print(anonymous_bytes())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


CUDA_CONTEXT_CODE = """
import pynvml, torch
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.step import make_optimizer, train_step
pynvml.nvmlInit()
uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)  # no CUDA context yet
handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
sae = SparseAutoencoder(256, 2048, "topk", 32, seed=0, device=torch.device("cuda"))
opt = make_optimizer(sae, 1e-3)
with torch.autocast("cuda", dtype=torch.bfloat16):
    train_step(sae, sae, opt, [torch.randn(512, 256, device="cuda")], None)
torch.cuda.synchronize()
used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
print(used - before - torch.cuda.memory_reserved(), before, used, torch.cuda.memory_reserved())
"""


def measured_cuda_context() -> int:
    """The CUDA context of a process that has run one training step: what NVML says the device
    uses now, less before the process touched it, less what torch's allocator has reserved."""
    out = subprocess.run([sys.executable, "-c", CUDA_CONTEXT_CODE], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"measuring the CUDA context failed:\n{out.stderr[-3000:]}")
    context, before, used, reserved = (int(v) for v in out.stdout.split())
    print(f"CUDA context: {context / MIB:.0f} MiB (device used {before / MIB:.0f} -> {used / MIB:.0f} MiB, "
          f"torch reserved {reserved / MIB:.0f} MiB)")
    return context


def run(cfg: Config, work: Path, shards: dict[int, Path],
        device: str = "cpu") -> tuple[float, float, float | None, float]:
    """(measured MiB, estimated MiB from the trainer's log, the largest resident size seen with
    file pages in MiB (one rank only), seconds) of one training run."""
    args = [sys.executable, "-m", "sae_dist", "train", "--no-db", "--architecture", cfg.architecture,
            "--d-sae", str(cfg.d_sae), "--batch-size", str(cfg.batch), "--k", str(cfg.k),
            "--steps", str(cfg.steps), "--log-every", str(max(1, cfg.steps // 2)), "--checkpoint-every", "0",
            "--devices", f"{device}:{cfg.ranks}", "--out-dir", str(work / f"run-{time.monotonic_ns()}"), *cfg.extra]
    if cfg.source == "shards":
        if cfg.d_in not in shards:
            shards[cfg.d_in] = write_shard_dir(work / f"shards-{cfg.d_in}", cfg.d_in)
        args += ["--source", "shards", "--shards-path", str(shards[cfg.d_in])]
    else:
        args += ["--d-in", str(cfg.d_in)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    resident = 0  # one rank runs in the launcher's process: its resident size, file pages included
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            resident = max(resident, int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024)
        except (OSError, AttributeError):
            pass
        time.sleep(0.05)
    took = time.perf_counter() - t0
    out = proc.stdout.read()
    found = FINAL.search(out)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{cfg.label}: exit {proc.returncode}\n{out[-3000:]}")
    return float(found.group(1)), float(found.group(2)), resident / MIB if cfg.ranks == 1 else None, took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated row numbers (from 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ns = parser.parse_args()
    configs = CUDA_CONFIGS if ns.device == "cuda" else CONFIGS
    rows = [int(i) for i in ns.only.split(",")] if ns.only else list(range(1, len(configs) + 1))
    if bad := [i for i in rows if not 1 <= i <= len(configs)]:
        print(f"error: --only {bad[0]}: rows are 1 to {len(configs)}", file=sys.stderr)
        return 2
    if ns.device == "cuda":
        return main_cuda([configs[i - 1] for i in rows])

    runtime = measured_runtime()
    print(f"runtime baseline: measured here {runtime / MIB:.1f} MiB (RssAnon after the imports), "
          f"constant in the estimate {CPU_RUNTIME_BYTES / MIB:.1f} MiB")
    print("est/meas: the estimate, and the anonymous peak the trainer measured; rss+files: the largest\n"
          "resident size seen from outside, file pages included (what a VmHWM-based peak would count)")
    header = (f"{'#':>2}  {'config':<54} {'est MiB':>8} {'meas MiB':>9} {'ratio':>6}  {'+-25%':<5} "
              f"{'rss+files':>9} {'s':>4}")
    print(header)
    print("-" * len(header))
    failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        shards: dict[int, Path] = {}
        for i in rows:
            cfg = configs[i - 1]
            expected = estimate_memory(cfg.d_in, cfg.d_sae, cfg.batch, cfg.architecture, cfg.k, cfg.ranks,
                                       device_type="cpu").total / MIB
            measured, estimated, resident, took = run(cfg, Path(tmp), shards)
            assert abs(estimated - expected) < 0.2, (estimated, expected)  # the trainer's own estimate
            ratio = estimated / measured
            ok = abs(estimated - measured) <= TOLERANCE * measured
            failed += not ok
            rss = f"{resident:.1f}" if resident is not None else "-"
            print(f"{i:>2}  {cfg.label:<54} {estimated:>8.1f} {measured:>9.1f} {ratio:>6.2f}  "
                  f"{'yes' if ok else 'NO':<5} {rss:>9} {took:>4.0f}", flush=True)
    return 1 if failed else 0


def main_cuda(configs: list[Config]) -> int:
    """The estimate against the allocator's peak plus the measured CUDA context, on one GPU."""
    context = measured_cuda_context()
    constant = CUDA_CONTEXT_BYTES / MIB
    print(f"the estimate's CUDA context: {constant:.0f} MiB (a constant); measured {context / MIB:.0f} MiB "
          f"({context / CUDA_CONTEXT_BYTES:.2f}x)")
    print("alloc: torch.cuda.max_memory_allocated of the run's steps; real: alloc + the measured context")
    header = (f"{'config':<46} {'est MiB':>8} {'alloc MiB':>10} {'real MiB':>9} {'est/real':>8}  {'+-25%':<5} "
              f"{'s':>4}")
    print(header)
    print("-" * len(header))
    failed = 0
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for cfg in configs:
            measured, estimated, _, took = run(cfg, Path(tmp), {}, device="cuda")
            allocated = measured - constant  # the trainer adds the constant to the allocator's peak
            real = allocated + context / MIB
            ok = abs(estimated - real) <= TOLERANCE * real
            failed += not ok
            print(f"{cfg.label:<46} {estimated:>8.0f} {allocated:>10.0f} {real:>9.0f} {estimated / real:>8.2f}  "
                  f"{'yes' if ok else 'NO':<5} {took:>4.0f}", flush=True)
            ratios.append(f"{estimated / real:.2f}")
    print(f"CUDA context measured {context / MIB:.0f} MiB (the estimate's constant: {constant:.0f}); estimate / "
          f"(allocator peak + context): {', '.join(ratios)} ({failed} outside +-{TOLERANCE:.0%})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

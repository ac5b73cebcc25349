"""Scaling arithmetic: speedup, efficiency, and the projection to more GPUs. Pure functions.

Measured figures come from `sae_dist.bench.measure`; everything here turns them into ratios, or
projects them with a written-down model (never shown as a measurement):

  ring all-reduce time  t_ar(N) = 2 (N - 1) / N x bytes / bandwidth
  step on N devices     no overlap: t_c(N) + t_ar(N)     full overlap: max(t_c(N), t_ar(N))
  compute per device    strong scaling: t_c(1) / N (the global batch is split)
                        weak scaling:   t_c(1)     (each device keeps its batch)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# Nominal one-direction bandwidths of common links, in bytes/s. All-reduce reaches a fraction of
# them in practice: measure the machine's own (`--link measured`) where it matters.
LINKS: dict[str, tuple[str, float]] = {
    "pcie4": ("PCIe 4.0 x16 (32 GB/s nominal)", 32e9),
    "pcie5": ("PCIe 5.0 x16 (64 GB/s nominal)", 64e9),
    "nvlink3": ("NVLink 3, A100 (300 GB/s per direction)", 300e9),
    "nvlink4": ("NVLink 4, H100 (450 GB/s per direction)", 450e9),
}
# The multi-GPU plan's targets: speedup by device count, and the efficiency floor.
TARGET_SPEEDUP = {2: 1.8, 4: 3.2}
TARGET_EFFICIENCY = 0.8


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """Half the range, relative to the median: "± x%" over repeats (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / 2 / median(values)


def speedup(throughput_n: float, throughput_1: float) -> float:
    return throughput_n / throughput_1


def efficiency(speedup_n: float, n: int) -> float:
    """Against ideal scaling: speedup / N."""
    return speedup_n / n


def efficiency_vs_ceiling(throughput_ddp: float, throughput_ceiling: float) -> float:
    """Against the same N processes running without communication on this machine: what DDP's
    communication costs, whatever the shared hardware allows."""
    return throughput_ddp / throughput_ceiling


def comm_share(step_s: float, step_without_comm_s: float) -> float:
    """Share of a step spent communicating: the step with gradient all-reduce against the same
    step without it (DDP's no_sync), clamped to [0, 1] against timing noise."""
    if step_s <= 0:
        return 0.0
    return min(1.0, max(0.0, (step_s - step_without_comm_s) / step_s))


def allreduce_time(n: int, nbytes: float, bandwidth: float) -> float:
    """Ring all-reduce: each device sends and receives 2 (N - 1) / N of the buffer."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth


@dataclass(frozen=True)
class Projection:
    n: int
    step_no_overlap_s: float
    step_overlap_s: float
    speedup_no_overlap: float
    speedup_overlap: float


def project(compute_1_s: float, grad_bytes: float, bandwidth: float, n: int, mode: str = "strong") -> Projection:
    """Expected step time and speedup on n devices from the single-device step time (all of it
    compute) and the gradient size, for a link of the given all-reduce bandwidth."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be strong or weak, got {mode!r}")
    compute = compute_1_s / n if mode == "strong" else compute_1_s
    comm = allreduce_time(n, grad_bytes, bandwidth)
    no_overlap, overlap = compute + comm, max(compute, comm)
    # Throughput ratio: strong moves the same global batch per step; weak moves n times more.
    work = 1 if mode == "strong" else n
    return Projection(n=n, step_no_overlap_s=no_overlap, step_overlap_s=overlap,
                      speedup_no_overlap=work * compute_1_s / no_overlap,
                      speedup_overlap=work * compute_1_s / overlap)


def break_even_batch(compute_1_s: float, batch_1: int, grad_bytes: float, bandwidth: float, n: int) -> float:
    """The per-device batch at which a step's compute equals its all-reduce on n devices: below it,
    communication dominates (an SAE has many parameters and little compute per sample). Compute
    is taken as proportional to the batch, from one measured point (batch_1 in compute_1_s)."""
    comm = allreduce_time(n, grad_bytes, bandwidth)
    return batch_1 * comm / compute_1_s if compute_1_s > 0 else float("inf")


def per_device_batch(mode: str, batch: int, n: int) -> int:
    """Strong scaling splits the global batch (batch) over n devices; weak keeps batch each."""
    if mode == "weak":
        return batch
    if batch % n:
        raise ValueError(f"strong scaling splits the global batch {batch} over {n} devices: "
                         f"choose a batch size divisible by {n}")
    return batch // n

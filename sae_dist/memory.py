"""How much memory a training config needs per device, and how much it really took.

The estimate (a pure function of the config's numbers) feeds the scheduler's GPU recommendation;
`PeakMemory` measures the same quantity on a run so the two can be compared: on CUDA the
allocator's peak, on CPU the growth of the process's peak resident memory over its baseline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    ddp_buckets: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.ddp_buckets + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(getattr(self, name))}"
                          for name in ("params", "grads", "optimizer", "ddp_buckets", "activations"))
        return f"{format_bytes(self.total)} per device ({parts})"


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def estimate_memory(d_in: int, d_sae: int, batch_size: int, architecture: str = "topk", k: int = 32,
                    world_size: int = 1, param_bytes: int = 4, act_bytes: int = 4,
                    auxk: bool = True) -> MemoryEstimate:
    """Peak bytes per device of one training step (fp32 weights, Adam, DDP with bucket views).

    Activations count the tensors of width d_sae alive at the peak: TopK keeps the
    pre-activations and their gradient (plus a transient for top-k and one for AuxK's masked
    copy); the dense architectures keep pre-activations, activations, a mask and two gradients.
    Tensors of width d_in (input, reconstruction, error and their gradients) add ~8 x B x d_in.
    """
    n_params = 2 * d_in * d_sae + d_sae + d_in + (d_sae if architecture == "jumprelu" else 0)
    params = n_params * param_bytes
    grads = n_params * param_bytes
    optimizer = 2 * n_params * param_bytes  # Adam's two moments
    # With gradient_as_bucket_view the buckets are the gradients; DDP still keeps a copy of the
    # largest bucket in flight, bounded by its bucket cap (25 MiB by default).
    ddp_buckets = min(25 * 2**20, n_params * param_bytes) if world_size > 1 else 0
    wide = {"topk": 3.0, "batchtopk": 7.0, "standard": 6.5, "jumprelu": 10.5}[architecture]
    if auxk and architecture in ("topk", "batchtopk"):
        wide += 1
    activations = int(batch_size * (wide * d_sae + 8 * d_in) * act_bytes)
    return MemoryEstimate(params, grads, optimizer, ddp_buckets, activations)


def estimate_for_config(cfg, world_size: int) -> MemoryEstimate:
    """The estimate for a TrainConfig whose d_in is known (the trainer, the CLI and the app agree)."""
    return estimate_memory(cfg.d_in, cfg.resolved_d_sae, cfg.batch_size, cfg.architecture, cfg.k, world_size,
                           auxk=cfg.auxk_coefficient > 0)


class PeakMemory:
    """Peak memory of this process since `reset()` (torch is imported here only: the estimate
    above is used by the app and the scheduler, which must not pay for importing torch)."""

    def __init__(self, device):
        self.device = device
        self.baseline = 0

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = 0
        else:
            _reset_peak_rss()
            self.baseline = _rss_bytes("VmRSS")

    def peak_bytes(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = _rss_bytes("VmHWM")
        return None if peak is None or self.baseline is None else max(0, peak - self.baseline)


def _rss_bytes(field: str) -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

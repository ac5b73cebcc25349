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


CPU_ENCODE_BLOCK_ELEMENTS = 1 << 22  # 16 MB of fp32 pre-activations: stays in a CPU's cache


def encoder_rows_at_once(batch_size: int, d_sae: int, device_type: str) -> int:
    """Rows of the pre-activation matrix that the TopK encoder holds at once: a block on a CPU
    (the product and its top-k stay in cache), the whole batch on a GPU (one big product)."""
    if device_type != "cpu":
        return batch_size
    return min(batch_size, max(64, CPU_ENCODE_BLOCK_ELEMENTS // d_sae))


def estimate_memory(d_in: int, d_sae: int, batch_size: int, architecture: str = "topk", k: int = 32,
                    world_size: int = 1, param_bytes: int = 4, act_bytes: int = 4,
                    device_type: str = "cuda") -> MemoryEstimate:
    """Peak bytes per device of one training step (fp32 weights, Adam, DDP with bucket views).

    Activations count the tensors of width d_sae alive at the peak. TopK / BatchTopK run through
    sparse_ops: the pre-activations exist once, during the encoder's forward (on a CPU only a
    block of rows at a time), plus half of that again for top-k's working space; BatchTopK adds
    its per-row candidates and the few rows it recomputes whole. Nothing of width d_sae is kept
    for the backward, whose sparse weight-gradient products take twice a weight's size
    (measured: MKL's copy and the result). The dense architectures keep about 4.5 (standard) and
    7.5 (JumpReLU) matrices of batch x d_sae at their peak (measured: pre-activations,
    activations, masks, gradients). Tensors of width d_in (input, reconstruction, error and their
    gradients) add ~8 x B x d_in.

    This counts tensors. On a CPU the measured peak is resident memory, which glibc's heap can
    push higher: freed blocks under its 32 MiB mmap ceiling stay in the heap (measured: TopK's
    CPU peak 10-50% over this estimate, run to run; with MALLOC_MMAP_THRESHOLD_=1048576 it
    matches, at a 20% cost in speed from the page faults, so that is not the default).
    """
    n_params = 2 * d_in * d_sae + d_sae + d_in + (d_sae if architecture == "jumprelu" else 0)
    params = n_params * param_bytes
    grads = n_params * param_bytes
    optimizer = 2 * n_params * param_bytes  # Adam's two moments
    # With gradient_as_bucket_view the buckets are the gradients; DDP still keeps a copy of the
    # largest bucket in flight, bounded by its bucket cap (25 MiB by default).
    ddp_buckets = min(25 * 2**20, n_params * param_bytes) if world_size > 1 else 0
    if architecture in ("topk", "batchtopk"):
        wide = 1.5 * encoder_rows_at_once(batch_size, d_sae, device_type) * d_sae * act_bytes
        wide += 2 * d_in * d_sae * param_bytes  # the backward's sparse weight-gradient product
        if architecture == "batchtopk":
            # 4k candidates per row (value and int64 index), and the rows that deserve more,
            # recomputed whole (a few percent of them; ~10% at initialisation, measured)
            wide += batch_size * 4 * k * (act_bytes + 8) + 0.1 * batch_size * d_sae * act_bytes
    else:
        wide = {"standard": 4.5, "jumprelu": 7.5}[architecture] * batch_size * d_sae * act_bytes
    activations = wide + 8 * batch_size * d_in * act_bytes
    return MemoryEstimate(params, grads, optimizer, ddp_buckets, int(activations))


def estimate_for_config(cfg, world_size: int, device_type: str | None = None) -> MemoryEstimate:
    """The estimate for a TrainConfig whose d_in is known (the trainer, the CLI and the app agree).
    Without a device type, `devices = cpu...` means CPU and anything else a GPU."""
    if device_type is None:
        device_type = "cpu" if str(cfg.devices).strip().lower().startswith("cpu") else "cuda"
    return estimate_memory(cfg.d_in, cfg.resolved_d_sae, cfg.batch_size, cfg.architecture, cfg.k, world_size,
                           device_type=device_type)


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

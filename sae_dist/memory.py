"""How much memory a training config needs per device, and how much it really took.

The estimate (a pure, torch-free function of the config's numbers) feeds the scheduler's GPU
recommendation and the app's "low memory" badges; `PeakMemory` measures the same quantity on a
run so that the two can be compared. Both count the whole process on its device, its runtime
baseline included: on CUDA the allocator's peak plus the CUDA context, on CPU the peak of the
rank's anonymous memory (pages of memory-mapped shards are the page cache's, not the rank's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sae_dist.config import TOPK_FAMILY
from sae_dist.config import batch_level as is_batch_level  # (the argument's name is batch_level)
from sae_dist.format import fmt_bytes

MIB = 2**20

# What a rank holds before its model, by device kind (the estimate's "runtime" part).
# CPU, measured on this project's machine (torch 2.13 CPU build, Python 3.12, x86-64 Linux): a
# rank's anonymous memory (RssAnon) just before it builds its model, torch and sae_dist
# imported, and with several ranks the gloo process group up. It is mostly torch's own: the
# pages of its libraries written at load time and its allocators' first arenas.
CPU_RUNTIME_BYTES = 216 * MIB
# CUDA: the CUDA context (driver, kernels of torch's libraries loaded on the device), which
# torch's allocator does not count. Measured on an H200 (driver 580, torch 2.11 + CUDA 13.0,
# 2026-11-27, scripts/bench_memory.py --device cuda): 748 MiB after a first training step (what
# the driver says the device uses, less what torch's allocator holds). PeakMemory adds the same
# constant to the allocator's peak, so measured and estimated count the same thing.
CUDA_CONTEXT_BYTES = 750 * MIB


# glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit): blocks this size and up
# are given back to the system when freed; smaller ones may stay in its heap.
GLIBC_MMAP_CEILING_BYTES = 32 * MIB


def runtime_bytes(device_type: str) -> int:
    """The estimate's runtime part: the process's baseline on this kind of device."""
    return CPU_RUNTIME_BYTES if device_type == "cpu" else CUDA_CONTEXT_BYTES


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    ddp_buckets: int
    activations: int
    heap: int = 0  # CPU: what glibc's heap keeps of the step's freed temporaries (see estimate_memory)
    runtime: int = 0  # the process before its model: see runtime_bytes
    refit: int = 0  # the decoder refit's sums and solve (refit_bytes), when the run refits

    PARTS = ("params", "grads", "optimizer", "ddp_buckets", "activations", "heap", "runtime", "refit")

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in self.PARTS)

    def describe(self) -> str:
        parts = ", ".join(f"{name} {fmt_bytes(getattr(self, name))}" for name in self.PARTS
                          if name != "refit" or self.refit)
        return f"{fmt_bytes(self.total)} per device ({parts})"


CPU_ENCODE_BLOCK_ELEMENTS = 1 << 22  # 16 MB of fp32 pre-activations: stays in a CPU's cache


def encoder_rows_at_once(batch_size: int, d_sae: int, device_type: str) -> int:
    """Rows of the pre-activation matrix that the TopK encoder holds at once: a block on a CPU
    (the product and its top-k stay in cache), the whole batch on a GPU (one big product)."""
    if device_type != "cpu":
        return batch_size
    return min(batch_size, max(64, CPU_ENCODE_BLOCK_ELEMENTS // d_sae))


def estimate_memory(d_in: int, d_sae: int, batch_size: int, architecture: str = "topk", k: int = 32,
                    world_size: int = 1, param_bytes: int = 4, act_bytes: int = 4,
                    device_type: str = "cuda", levels: int = 1, batch_level: bool | None = None,
                    skip: bool = False, inner_offset_rows: int = 0) -> MemoryEstimate:
    """Peak bytes per device of one training step (fp32 weights, Adam, DDP with bucket views).

    Activations count the tensors of width d_sae alive at the peak. TopK / BatchTopK run through
    sparse_ops: the pre-activations exist once, during the encoder's forward (on a CPU only a
    block of rows at a time), plus half of that again for top-k's working space; BatchTopK adds
    its per-row candidates and the few rows it recomputes whole; Matryoshka, for each of its
    `levels` but the last, a prefix's reconstruction, its error and that error's gradient (width
    d_in, a guess from what autograd keeps: not measured yet). Nothing of width d_sae is kept
    for the backward, whose sparse weight-gradient products take twice a weight's size
    (measured: MKL's copy and the result). The dense architectures keep about 4.5 (standard) and
    7.5 (JumpReLU) matrices of batch x d_sae at their peak (measured: pre-activations,
    activations, masks, gradients). Tensors of width d_in (input, reconstruction, error and their
    gradients) add ~8 x B x d_in. Matryoshka's inner offset (`inner_offset_rows` rows of d_in) is
    a parameter like the others, and the inner prefixes' decoder it makes each step (its rows of
    W_dec plus it) and that decoder's gradient are two more of the offset's size.

    The runtime part is the process before its model (runtime_bytes): on a CPU the rank's
    anonymous memory with torch loaded, on a GPU the CUDA context.

    The heap part is for a CPU's glibc: a freed block under its mmap ceiling (32 MiB at most)
    stays in its heap, where the next step's blocks do not always fit, so the step's smaller
    temporaries can take their size once more; the more steps, the closer to that. Measured here
    (d_in 128, batch 1024, runs of 6 to 30 steps; the anonymous peak over the estimate without
    this part): standard d_sae 4096 (16 MiB matrices) 19-33% over, its temporaries held 0.8-1.3
    times more; standard d_sae 16384 (64 MiB matrices, given back) 2-5%; TopK d_sae 16384 (16 MiB
    encoder blocks) 4-9%, 0.3-0.7 times its temporaries. With MALLOC_MMAP_THRESHOLD_=1048576 the
    heap keeps nothing (within 3% without this part), at a 20% cost in speed.
    """
    n_params = (2 * d_in * d_sae + d_sae + d_in + (d_sae if architecture == "jumprelu" else 0)
                + (d_in * d_in if skip else 0)  # a skip transcoder's W_skip
                + inner_offset_rows * d_in)  # Matryoshka's inner offset
    params = n_params * param_bytes
    grads = n_params * param_bytes
    optimizer = 2 * n_params * param_bytes  # Adam's two moments
    # With gradient_as_bucket_view the buckets are the gradients; DDP still keeps a copy of the
    # largest bucket in flight, bounded by its bucket cap (25 MiB by default).
    ddp_buckets = min(25 * 2**20, n_params * param_bytes) if world_size > 1 else 0
    # The step's temporaries, as (bytes of one, how many): what is alive at the step's peak.
    batch_level = is_batch_level(architecture) if batch_level is None else batch_level
    if architecture in TOPK_FAMILY and device_type != "cpu":
        # A GPU's peak is the larger of the forward's and the backward's (measured on an H200 in
        # bf16, d_in/d_sae 768/24576, 2048/32768, 4096/65536, batch 4096: the estimate came within
        # 2-10% above the allocator's peak): the forward holds the whole batch's pre-activations
        # and, under autocast, the encoder's weight in that dtype; the backward's sparse
        # weight-gradient product takes twice a weight (its result and cuSPARSE's workspace).
        weight = d_in * d_sae * param_bytes
        forward = batch_size * d_sae * act_bytes + (d_in * d_sae * act_bytes if act_bytes < param_bytes else 0)
        temporaries = [(max(forward, 2 * weight), 1)]
        if batch_level:
            temporaries += [(batch_size * 4 * k * act_bytes, 1), (batch_size * 4 * k * 8, 1),
                            (0.1 * batch_size * d_sae * act_bytes, 1)]
    elif architecture in TOPK_FAMILY:
        block = encoder_rows_at_once(batch_size, d_sae, device_type) * d_sae * act_bytes
        temporaries = [(block, 1.5),  # the pre-activations (a block of rows on a CPU), top-k's space
                       (d_in * d_sae * param_bytes, 2)]  # the backward's sparse weight-gradient product
        if batch_level:
            # 4k candidates per row (value and int64 index), and the rows that deserve more,
            # recomputed whole (a few percent of them; ~10% at initialisation, measured)
            temporaries += [(batch_size * 4 * k * act_bytes, 1), (batch_size * 4 * k * 8, 1),
                            (0.1 * batch_size * d_sae * act_bytes, 1)]
    else:
        temporaries = [(batch_size * d_sae * act_bytes, {"standard": 4.5, "jumprelu": 7.5}[architecture])]
    if inner_offset_rows:
        temporaries.append((d_in * inner_offset_rows * param_bytes, 2))  # the inner prefixes' decoder and its gradient
    temporaries.append((batch_size * d_in * 4, 8 + 3 * (levels - 1)))  # fp32: autocast covers the encoder only
    activations = sum(size * count for size, count in temporaries)
    heap = 0.0
    if device_type == "cpu":
        heap = sum(size * count for size, count in temporaries if size < GLIBC_MMAP_CEILING_BYTES)
    return MemoryEstimate(params, grads, optimizer, ddp_buckets, int(activations), int(heap),
                          runtime_bytes(device_type))


def estimate_for_config(cfg, world_size: int, device_type: str | None = None) -> MemoryEstimate:
    """The estimate for a TrainConfig whose d_in is known (the trainer, the CLI and the app agree).
    Without a device type, `devices = cpu...` means CPU and anything else a GPU. On a GPU,
    precision `auto` is taken as bf16 (what it means on every GPU since Ampere)."""
    if device_type is None:
        device_type = "cpu" if str(cfg.devices).strip().lower().startswith("cpu") else "cuda"
    act_bytes = 2 if device_type != "cpu" and cfg.precision in ("auto", "bf16") else 4
    levels = len(cfg.resolved_matryoshka_widths) if cfg.architecture == "matryoshka" else 1
    estimate = estimate_memory(cfg.d_in, cfg.resolved_d_sae, cfg.batch_size, cfg.architecture, cfg.k, world_size,
                               act_bytes=act_bytes, device_type=device_type, levels=levels,
                               batch_level=cfg.batch_level, skip=cfg.skip,
                               inner_offset_rows=(cfg.resolved_matryoshka_widths[-2] if levels > 1 and
                                                  cfg.resolved_matryoshka_inner_offset else 0))
    if cfg.resolved_refit_fraction:
        estimate = replace(estimate, refit=refit_bytes(cfg.resolved_d_sae, cfg.d_in, cfg.batch_size, cfg.k))
    return estimate


def refit_bytes(d_sae: int, d_out: int, batch_size: int, k: int) -> int:
    """The decoder refit (sae_dist.models.refit): its int64 sums, Z^T Z [d_sae, d_sae] and Z^T Y
    [d_sae, d_out], and each latent's firings, kept through the window, and at the end their
    float64 copies and the solve's factor, an upper bound (the solve runs after the last step, when
    the step's activations are gone); a step's k x k pairs a row (index, product, fixed point: 24
    bytes each)."""
    return 3 * 8 * d_sae * d_sae + 3 * 8 * d_sae * d_out + 3 * 8 * d_sae + 24 * batch_size * k * k


class PeakMemory:
    """Peak memory of this rank since `reset()`, counted as the estimate counts it (torch is
    imported here only: the estimate above is used by the app and the scheduler, which must not
    pay for importing torch).

    CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`) plus CUDA_CONTEXT_BYTES, the
    same documented constant the estimate adds (the context is not measured: see there).

    CPU: the peak of the process's anonymous memory (heap, tensors, thread stacks, library pages
    written at load time), the whole of it, runtime baseline included. Pages of mapped files are
    left out: the memory-mapped shards' pages belong to the page cache, shared and reclaimable.
    Linux keeps no peak of anonymous memory, only VmHWM, the peak of all resident pages, file
    pages included. So each reading covers a window (from the previous reading, or reset(), to
    now) and takes VmHWM minus the larger of the file-backed and shmem pages resident at the
    window's start and at its end (and no less than the anonymous pages resident at either end);
    it then resets VmHWM (Linux's clear_refs) for the next window. The peak is the largest window.

      * Exact when the file pages do not change within the window.
      * When they grow (shard pages faulted in), it is low by the pages added after the anonymous
        peak. The trainer reads once per report, at the end of a step: a step gathers its rows
        before its forward and backward, where its peak is, so little is missed.
      * When they shrink (unmapped, or reclaimed under memory pressure), it is low by the pages
        dropped before the peak; it is never inflated by pages that were mapped and later dropped.
      * Only file pages that come and go within one window (mapped after its start, dropped
        before its end) can inflate it: the shards stay mapped for the whole run.

    A reading is two reads of /proc/self/status and one write to /proc/self/clear_refs (0.2 ms
    here), once per report, not per step. Elsewhere than Linux: None.
    """

    def __init__(self, device):
        self.device = device
        self._peak: int | None = None
        self._start: dict[str, int] | None = None  # the window's start: anonymous and file pages

    def reset(self) -> None:
        import torch

        self._peak = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._start = _new_window()

    def peak_bytes(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device)) + CUDA_CONTEXT_BYTES
        now = _status_bytes("VmHWM", "RssAnon", "RssFile", "RssShmem")
        start, self._start = self._start, _new_window()
        if now is not None and start is not None:
            file_pages = max(start["file"], now["RssFile"] + now["RssShmem"])
            window = max(now["VmHWM"] - file_pages, now["RssAnon"], start["anon"])
            self._peak = window if self._peak is None else max(self._peak, window)
        return self._peak


def _status_bytes(*fields: str) -> dict[str, int] | None:
    """Fields of /proc/self/status in bytes (None where there is no such file or field)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    found[name] = int(value.split()[0]) * 1024  # "kB"
    except (OSError, ValueError, IndexError):
        return None
    return found if len(found) == len(fields) else None


def anonymous_bytes() -> int | None:
    """This process's resident anonymous memory now (RssAnon), Linux only."""
    got = _status_bytes("RssAnon")
    return got["RssAnon"] if got else None


def _new_window() -> dict[str, int] | None:
    """Reset VmHWM to the resident size now; the anonymous and file pages it is made of."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: 5 resets VmHWM (and nothing else)
    except OSError:
        return None  # no reset: a window's VmHWM would not be its own
    got = _status_bytes("RssAnon", "RssFile", "RssShmem")
    return None if got is None else {"anon": got["RssAnon"], "file": got["RssFile"] + got["RssShmem"]}

"""One optimizer step of an SAE, and what it runs on: shared by the trainer and the benchmarks,
so that what a benchmark times is what a training run does.

- Adam is `fused` on CPU and GPU alike (torch >= 2.4): at 4M parameters 2 ms a step on this
  machine's CPU where `foreach` takes 12.
- bf16 autocast covers the encoder's product only (see sparse_ops); TF32 is allowed for the fp32
  products on GPUs that have it.
- DDP: gradients live in the buckets (`gradient_as_bucket_view`); the decoder's gradient, which
  the backward produces first, gets a bucket of its own so its all-reduce runs while the
  encoder's backward is still computing; optional bf16/fp16 compression of the all-reduce.
- Gradient accumulation: several micro-batches per step under `no_sync`, one all-reduce.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from sae_dist.config import TrainConfig
from sae_dist.distributed import DistContext
from sae_dist.models.sae import SaeOutput, SparseAutoencoder


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (
        cfg.precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())


def autocast_for(cfg: TrainConfig, device: torch.device):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 products on tensor cores where present
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16(cfg, device) else nullcontext()


def make_optimizer(sae: SparseAutoencoder, lr: float, decoder_lr_factor: float = 1.0) -> torch.optim.Adam:
    """Adam over the SAE's parameters: one group at `lr`, or, with a decoder factor, two (the rest,
    then W_dec at the factor times the lr; `set_lr` keeps it so)."""
    groups = [{"params": params} for params in _param_groups(sae, decoder_lr_factor != 1)]
    opt = torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.999), fused=True)
    set_lr(opt, lr, decoder_lr_factor)
    return opt


def optimizer_for(sae: SparseAutoencoder, cfg: TrainConfig) -> torch.optim.Adam:
    """The optimizer a run's config asks for: at its lr, the decoder at its factor. Built once
    per SAE, and again where a resume drops a parameter (sae_dist.train.state)."""
    return make_optimizer(sae, cfg.resolved_lr, cfg.resolved_decoder_lr_factor)


def _param_groups(sae: SparseAutoencoder, decoder_apart: bool) -> list[list[torch.nn.Parameter]]:
    if not decoder_apart:
        return [list(sae.parameters())]
    return [[p for p in sae.parameters() if p is not sae.W_dec], [sae.W_dec]]


def set_lr(opt: torch.optim.Adam, lr: float, decoder_lr_factor: float) -> None:
    """The step's learning rate: the decoder's group, where it has one, at the factor times it."""
    for i, group in enumerate(opt.param_groups):
        group["lr"] = lr * decoder_lr_factor if i == 1 else lr


def load_optimizer(opt: torch.optim.Adam, sae: SparseAutoencoder, saved: dict) -> None:
    """A checkpoint's optimizer state, into groups laid out as this run's: a run saved with one
    group (no decoder factor, or from before the factor) resumes with one, and back."""
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        # torch matches saved ids to parameters by position in the groups, so list the saved ids
        # of the same parameters in this optimizer's order; the moments stay with their parameters.
        then = _param_groups(sae, decoder_apart=len(groups) == 2)
        saved_id = {id(p): i for group, params in zip(groups, then) for i, p in zip(group["params"], params)}
        saved = {**saved, "param_groups": [{**groups[0], "params": [saved_id[id(p)] for p in group["params"]]}
                                           for group in opt.param_groups]}
    opt.load_state_dict(saved)


def ddp_bucket_mb(sae: SparseAutoencoder, cfg: TrainConfig) -> float:
    """The configured bucket size, or just over the decoder's gradient so that it is one bucket."""
    if cfg.ddp_bucket_mb is not None:
        return cfg.ddp_bucket_mb
    return sae.W_dec.numel() * sae.W_dec.element_size() / 2**20  # a bucket closes when it reaches the cap


def wrap_ddp(sae: SparseAutoencoder, ctx: DistContext, cfg: TrainConfig, ranks: int | None = None, group=None):
    """The model the loop calls: the SAE itself on one rank, DDP around it over `group` (default:
    every rank) of `ranks` ranks."""
    if (ranks or ctx.world_size) == 1:
        return sae
    # The only buffer (BatchTopK's threshold) follows the group's first rank, DDP's default.
    model = DDP(sae, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, process_group=group,
                gradient_as_bucket_view=True, bucket_cap_mb=ddp_bucket_mb(sae, cfg))
    if cfg.ddp_compress != "none":
        model.register_comm_hook(
            None, compress_hook(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[cfg.ddp_compress]), group))
    return model


def compress_hook(dtype: torch.dtype, group=None):
    """A DDP comm hook that all-reduces each bucket in `dtype` over `group` (torch's own bf16 hook
    insists on NCCL; gloo sums bf16 as well, so this one serves both backends)."""
    import torch.distributed as dist

    def hook(_state, bucket):
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook


@dataclass
class StepResult:
    outputs: list[SaeOutput]  # one per micro-batch
    forward_done: float  # perf_counter when the last forward ended, before any collective
    grad_norm: float | None  # of the averaged gradient, when asked for (it costs a device sync)


def train_step(model, sae: SparseAutoencoder, opt: torch.optim.Optimizer, batches: list[Tensor],
               dead_mask: Tensor | None, autocast=None, grad_norm: bool = False, loss_scale: float | None = None,
               slowdown: float = 1.0, selection_bias: Tensor | None = None) -> StepResult:
    """Forward and backward over the micro-batches (all-reduce on the last only), the decoder
    constraint and the optimizer step.

    `loss_scale` multiplies each micro-batch's mean loss (default 1 / micro-batches): with unequal
    shares it is this rank's part of the micro-batch x world size (sae_dist.train.balance.BatchPlan), so
    that DDP's average is the whole batch's gradient. `slowdown` > 1 stretches each forward by
    sleeping (tests: a slower card on virtual devices). `selection_bias`: the rare latents' bias
    on which latents fire (sae_dist.train.rare_bias), None where there is none."""
    autocast = autocast if autocast is not None else nullcontext()
    scale = loss_scale if loss_scale is not None else 1 / len(batches)
    outs = []
    forward_done = time.perf_counter()
    last = len(batches) - 1
    for i, x in enumerate(batches):
        with (model.no_sync() if i < last and isinstance(model, DDP) else nullcontext()):
            started = time.perf_counter()
            with autocast:
                out = model(x, dead_mask, selection_bias)
            if x.device.type == "cuda" and (i == last or slowdown > 1):
                torch.cuda.synchronize(x.device)
            if slowdown > 1:
                time.sleep((time.perf_counter() - started) * (slowdown - 1))
            if i == last:
                forward_done = time.perf_counter()
            (out.loss * scale if scale != 1 else out.loss).backward()
        outs.append(out)
    sae.remove_parallel_gradient()
    norm = _grad_norm(sae) if grad_norm else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    sae.normalize_decoder()
    return StepResult(outs, forward_done, norm)


def _grad_norm(sae: SparseAutoencoder) -> float:
    grads = [p.grad for p in sae.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))

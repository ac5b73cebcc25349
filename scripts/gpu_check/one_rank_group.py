"""A one-rank process group and its collectives through the trainer's own helpers
(sae_dist.distributed, sae_dist.train.step.wrap_ddp): what of NCCL one GPU can show.

    python3 scripts/gpu_check/one_rank_group.py            # NCCL on cuda:0
    python3 scripts/gpu_check/one_rank_group.py --gloo     # the rehearsal: gloo on the CPU

Each collective must give back what one rank put in; a DDP step (its gradient bucket all-reduced
over the group, plain and bf16-compressed) must equal the same step without DDP. Two ranks need
two GPUs (NCCL refuses two ranks on one device): the 2-GPU training test and the scaling
benchmark stay for a machine with more.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

from harness import CheckFailed, expect, run_step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    gloo = "--gloo" in sys.argv[1:]
    import torch
    import torch.distributed as dist

    from sae_dist import distributed as D
    from sae_dist.config import TrainConfig
    from sae_dist.contract import DEVICE_TYPE_ENV
    from sae_dist.models.sae import SparseAutoencoder
    from sae_dist.train.step import autocast_for, make_optimizer, train_step, wrap_ddp

    if not gloo and not torch.cuda.is_available():
        raise CheckFailed("torch sees no CUDA device")
    kind = "cpu" if gloo else "cuda"
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", DEVICE_TYPE_ENV: kind})
    backend = "gloo" if gloo else "nccl"
    device = torch.device("cpu") if gloo else torch.device("cuda", 0)
    started = time.perf_counter()
    # init_distributed forms a group only for several ranks; the call is the one it makes.
    dist.init_process_group(backend=backend, device_id=None if gloo else device)
    ctx = D.init_distributed()
    up = time.perf_counter() - started
    expect(D.active() and dist.get_backend() == backend, f"no {backend} group: {dist.get_backend()}")
    t = torch.arange(6, dtype=torch.float32, device=device)
    expect(torch.equal(D.all_reduce_sum(t.clone()), t), "all_reduce_sum changed one rank's tensor")
    expect(torch.equal(D.all_gather_rows(t), t.unsqueeze(0)), "all_gather_rows is not [1, n]")
    expect(D.broadcast_object({"step": 7}) == {"step": 7}, "broadcast_object lost the object")
    expect(D.gather_objects(("rank", 0)) == [("rank", 0)], "gather_objects lost the object")
    D.barrier()
    print(f"{backend} group of 1 up in {up:.1f} s on {device}; all_reduce, all_gather, broadcast_object, "
          f"gather_objects, barrier: each gave back what the rank put in")

    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(1)).to(device)
    for compress in ("none", "bf16"):
        cfg = TrainConfig(d_in=256, d_sae=2048, k=32, precision="fp32", ddp_compress=compress)
        alone, wrapped = (SparseAutoencoder(256, 2048, "topk", 32, seed=0, device=device) for _ in range(2))
        # wrap_ddp wraps only when there are peers; a context claiming one lets DDP's own path
        # (bucket views, the decoder's bucket, the compression hook) run over this one-rank group.
        model = wrap_ddp(wrapped, dataclasses.replace(ctx, world_size=2), cfg)
        expect(type(model).__name__ == "DistributedDataParallel", "wrap_ddp did not wrap")
        for sae, m in ((alone, alone), (wrapped, model)):
            opt = make_optimizer(sae, 1e-3)
            for _ in range(2):
                train_step(m, sae, opt, [x], None, autocast=autocast_for(cfg, device))
        with torch.no_grad():
            worst = max(float((a - b).norm() / a.norm()) for a, b in zip(alone.parameters(), wrapped.parameters()))
        # the GPU's sparse backward sums with atomics: the order, not the group, differs
        limit = 1e-5 if compress == "none" else 1e-2
        print(f"DDP step over the group, compression {compress}: parameters differ from the step alone by "
              f"{worst:.1e} (relative; at most {limit:.0e})")
        expect(worst <= limit, f"DDP ({compress}) moved the parameters {worst:.1e} away from the step alone")
    D.shutdown()
    print(f"{backend}: a one-rank group, our collectives and DDP steps (plain and bf16-compressed) agree with "
          f"one rank alone; two ranks need two GPUs")
    return 0


if __name__ == "__main__":
    run_step(main)

"""Process-group plumbing that also works with one process and no process group at all.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them we are a single rank and every
collective below is the identity (sparsify's `maybe_all_reduce` idea), so the training loop has
one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sae_dist.contract import DEVICE_TYPE_ENV


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "nccl", "gloo", or "none" for a single process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistContext:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Unset under a bare `torchrun -m sae_dist train`: CUDA when present.
    kind = os.environ.get(DEVICE_TYPE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "none"
    if world_size > 1:
        backend = "nccl" if kind == "cuda" else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=device if kind == "cuda" else None)
    return DistContext(rank, world_size, local_rank, device, backend)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Stack each rank's 1-D tensor into [world_size, n] (on every rank)."""
    if not active():
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's object on every rank (pickled; for small state and checkpoints)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    if active():
        dist.destroy_process_group()

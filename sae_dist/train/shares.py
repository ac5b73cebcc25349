"""How a step's samples are first shared among the ranks, at a start or a resume.

The shares come from measurements on the devices (free memory, or forward + backward speed),
gathered so that every rank computes the same plan; the decisions themselves are pure functions
in sae_dist.train.balance. See docs/architecture.md.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract import SLOW_RANKS_ENV, rank_values
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.balance import BatchPlan, bounded_split, initial_weights, plan_for
from sae_dist.train.free_memory import free_memory, sources_line

SPEED_PROBES = 3


def slowdown_for_tests(rank: int) -> float:
    """This rank's factor from $SAE_DIST_TEST_SLOW_RANKS ("rank:factor,..."), 1.0 when unset: a
    stand-in for a slower card on virtual devices."""
    factors = rank_values(SLOW_RANKS_ENV, os.environ.get(SLOW_RANKS_ENV, "").strip(), float, 1.0,
                          "1:3 (rank 1 computes 3x slower; a factor is at least 1)")
    return factors.get(rank, 1.0)


def first_plan(cfg: TrainConfig, ctx: D.DistContext, probe: list, slowdown: float) -> tuple[BatchPlan, str]:
    """`probe`: the SAEs this rank trains on its share of the rows (what --balance speed times)."""
    micro = cfg.batch_size * ctx.world_size
    weights, why = _balance_weights(cfg, ctx, probe, cfg.batch_size, slowdown)
    return BatchPlan(micro * cfg.grad_accum, cfg.grad_accum, bounded_split(micro, weights)), why


def resumed_plan(cfg: TrainConfig, ctx: D.DistContext, saved: dict | None, saved_world: int, probe: list,
                 slowdown: float) -> tuple[BatchPlan, str]:
    """The plan of a resumed run: the checkpoint's (shares included) on as many ranks; on another
    number of ranks its global batch, in as many micro-batches as keep each rank's batch at most
    the configured one, so the training curve goes on as it was."""
    world = ctx.world_size
    if saved_world == world or not saved_world:
        plan = BatchPlan.from_dict(saved) if saved else None
        if plan and plan.world_size == world and plan.micro_steps == cfg.grad_accum and \
                plan.global_batch == cfg.batch_size * world * cfg.grad_accum:
            return plan, "the checkpoint's shares"
        return first_plan(cfg, ctx, probe, slowdown)  # the batch settings were changed on resume
    global_batch = int(saved["global_batch"]) if saved else cfg.batch_size * saved_world * cfg.grad_accum
    micro_steps, micro = plan_for(global_batch, world, cfg.batch_size)
    weights, why = _balance_weights(cfg, ctx, probe, max(1, micro // world), slowdown)
    return (BatchPlan(global_batch, micro_steps, bounded_split(micro, weights)),
            f"global batch {global_batch} kept as {micro_steps} micro-batches of {micro}; shares {why}")


def _balance_weights(cfg: TrainConfig, ctx: D.DistContext, probe: list, rows: int,
                     slowdown: float) -> tuple[list[float], str]:
    world = ctx.world_size
    if world == 1 or cfg.balance == "equal":
        return [1.0] * world, "equal"
    if cfg.balance == "memory":
        free, sources = zip(*D.gather_objects(free_memory(ctx.device)))
        weights, why = initial_weights(cfg.balance, list(free), [None] * world)
        return weights, f"{why}; {sources_line(list(sources))}"
    speed = [None] * world
    if cfg.balance == "speed":
        # Together: a rank still starting up (reading a model, filling its buffer) would take
        # the cores of one already measuring, on a machine whose devices share them.
        D.barrier()
        speed = D.gather_objects(_measure_speed(probe, ctx.device, rows, slowdown))
    return initial_weights(cfg.balance, [None] * world, speed)


def _measure_speed(saes: list[SparseAutoencoder], device: torch.device, rows: int, slowdown: float) -> float | None:
    """Samples per second of forward + backward of every SAE in `saes` on this rank, on random
    rows; the weights, their gradients and the buffers are left as they were. None without one."""
    if not saes:
        return None
    buffers = [{name: b.clone() for name, b in sae.named_buffers()} for sae in saes]
    x = torch.randn(rows, saes[0].d_in, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(SPEED_PROBES):
        t0 = time.perf_counter()
        for sae in saes:
            sae(x).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        time.sleep(elapsed * (slowdown - 1))
        times.append(elapsed * slowdown)
    for sae, saved in zip(saes, buffers):
        sae.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in sae.named_buffers():
                b.copy_(saved[name])
    median = statistics.median(times)
    return rows / median if median > 0 else None

"""The decoder refit in a run (sae_dist.models.refit): which steps feed it, the sums each rank
gathers from its forward passes, their place in a checkpoint, and the solve after the last step.

Only the ranks of an SAE's group hold its sums. A checkpoint taken inside the window first sums
them onto the group's leader, which saves them beside the optimizer; the other ranks go on from
zero. At the end the leader solves and sends the new decoder to the rest of its group.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from sae_dist.models.refit import DecoderRefit
from sae_dist.models.sae import SaeOutput

log = logging.getLogger(__name__)


def window_start(steps: int, fraction: float) -> int:
    """The last step before the refit's window: steps after it feed the refit (at least the
    last one when `fraction` > 0); `steps` when there is no refit."""
    if fraction <= 0:
        return steps
    return steps - min(steps, max(1, round(steps * fraction)))


def in_window(m, step: int, steps: int) -> bool:
    return bool(m.cfg.resolved_refit_fraction) and step > window_start(steps, m.cfg.resolved_refit_fraction)


def gather(m, outputs: list[SaeOutput], step: int, steps: int) -> None:
    """This rank's micro-batches of the step into the SAE's sums, inside the window (started at
    its first step); nothing outside it."""
    if not in_window(m, step, steps):
        return
    if m.refit is None:
        m.refit = DecoderRefit(m.sae.d_sae, m.sae.d_in, m.sae.W_dec.device)
    if m.refit.scales is None:
        first = outputs[0]
        m.refit.set_scales(first.codes.acts, first.goal, m.group, len(m.ranks))
    for out in outputs:
        m.refit.add(out.codes.pattern, out.codes.acts, out.goal)


def to_checkpoint(m, rank: int) -> dict:
    """{"refit": sums} for the leader's checkpoint of an SAE inside its window ({} otherwise);
    every rank of the group calls it (the sums meet on the leader)."""
    if m.refit is None or not (m.here and m.live):
        return {}
    m.refit.reduce_to(m.leader, m.group, len(m.ranks), is_leader=rank == m.leader)
    return {"refit": m.refit.state_dict()} if rank == m.leader else {}


def from_checkpoint(m, state: dict, rank: int, step: int, steps: int) -> None:
    """The sums a checkpoint kept, on the leader (the others start from zero); none when the
    checkpoint has none or its step is no longer inside this run's window (more steps asked)."""
    m.refit = None
    saved = state.get("refit")
    if saved is None or not in_window(m, step, steps):
        return
    m.refit = DecoderRefit(m.sae.d_sae, m.sae.d_in, m.sae.W_dec.device)
    m.refit.load_state_dict(saved, keep=rank == m.leader)


def refit_decoders(members: list, rank: int, steps: int) -> None:
    """After the last step, every SAE's of the job that has sums (the same order on every rank)."""
    for m in members:
        refit_decoder(m, rank, steps)


def refit_decoder(m, rank: int, steps: int) -> None:
    """After the last step: the group's sums onto its leader, the leader's solve, the new decoder
    on every rank of the group. The sums are then spent."""
    if m.refit is None or not (m.here and m.live):
        return
    leader = rank == m.leader
    m.refit.reduce_to(m.leader, m.group, len(m.ranks), is_leader=leader)
    w = m.sae.W_dec.data
    if leader:
        w.copy_(m.refit.solve(w))
        log.info("%sdecoder refit by least squares to the codes of the last %d steps",
                 f"{m.name}: " if m.name else "", steps - window_start(steps, m.cfg.resolved_refit_fraction))
    if len(m.ranks) > 1:
        dist.broadcast(w, src=m.leader, group=m.group)
    m.refit = None

"""Matryoshka's inner weight over the run: high at the start, then the configured weight.

Early, a strong pull of the inner prefixes' own reconstructions makes each inner latent stand for
what its children share, which finds a hierarchy's parents; later the whole dictionary's loss,
at the configured weight, fits the rest around them. On the planted hierarchies this lowered FVU
and kept or raised the parents recovered (docs/quality.md, "The inner weight's schedule").
"""

from __future__ import annotations


def inner_weight_at(step: int, total_steps: int, weight: float, start: float, until: float) -> float:
    """The inner weight for optimizer step `step` (1-based) of `total_steps`: `start`, held for
    the first half of `until` (a fraction of the steps), then linear to `weight` at `until`, and
    `weight` from there on. `start == weight` is no schedule."""
    t = step / max(total_steps, 1)
    hold = until / 2
    if start == weight or t >= until:
        return weight
    if t <= hold:
        return start
    return start + (weight - start) * (t - hold) / (until - hold)

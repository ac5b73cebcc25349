"""How a step's samples are shared among the ranks: pure decisions, tested with plain numbers.

A step trains on `global_batch` samples in `micro_steps` micro-batches; in each micro-batch rank r
takes `shares[r]` samples (the shares add up to global_batch / micro_steps). Each rank scales its
loss by its share of the micro-batch (`loss_scales`), so DDP's plain average of the gradients is
the gradient of the whole batch's mean loss, whatever the split: unequal shares change who does
the work, never what is learnt.

Shares start equal, in proportion to free memory or to measured speed (`initial_weights`), and
move away from a straggler (`rebalance`): to each rank in proportion to its measured samples per
second, bounded to [MIN_SHARE, MAX_SHARE] x the equal share (a rank never takes more than twice the
batch it was configured for: its memory; nor less than a quarter). A rank that is slower than the
others even at the smallest share is reported: rebalancing cannot help it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_SHARE = 0.25  # x the equal share
MAX_SHARE = 2.0
REBALANCE_AT = 1.2  # slowest / fastest compute time over a window that triggers a rebalance
MIN_GAP_S = 0.002  # ...and at least this much slower in absolute terms (jitter on tiny steps)
LIMITED_AT = 1.5  # predicted imbalance after rebalancing that is reported as "cannot help"
MIN_CHANGE = 0.05  # shares move only when some rank's share changes by this fraction or more


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # samples per optimizer step, over every rank and micro-batch
    micro_steps: int
    shares: tuple[int, ...]  # per rank, samples in each micro-batch

    def __post_init__(self) -> None:
        if self.global_batch % self.micro_steps or sum(self.shares) != self.micro_batch:
            raise ValueError(f"shares {self.shares} x {self.micro_steps} micro-steps do not make "
                             f"the global batch {self.global_batch}")
        if min(self.shares) < 1:
            raise ValueError(f"every rank needs at least one sample, got shares {self.shares}")

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.micro_steps

    @property
    def world_size(self) -> int:
        return len(self.shares)

    def offset(self, rank: int) -> int:
        """Where rank's slice starts in each micro-batch."""
        return sum(self.shares[:rank])

    def loss_scale(self, rank: int) -> float:
        """Factor on rank's mean loss of one micro-batch so that DDP's average over the ranks, summed
        over the micro-batches, is the mean loss over the global batch."""
        return self.world_size * self.shares[rank] / self.global_batch

    def per_step(self, rank: int) -> int:
        return self.shares[rank] * self.micro_steps

    def to_dict(self) -> dict:
        return {"global_batch": self.global_batch, "micro_steps": self.micro_steps, "shares": list(self.shares)}

    @classmethod
    def from_dict(cls, d: dict) -> BatchPlan:
        return cls(int(d["global_batch"]), int(d["micro_steps"]), tuple(int(s) for s in d["shares"]))


def split(total: int, weights: list[float]) -> tuple[int, ...]:
    """`total` in whole parts proportional to `weights` (largest remainder), each at least 1."""
    n = len(weights)
    if total < n:
        raise ValueError(f"cannot share {total} samples among {n} ranks (one each at least)")
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        weights = [1.0] * n  # nothing measured (or nonsense): equal
    scale = (total - n) / sum(weights)
    exact = [w * scale for w in weights]
    parts = [1 + math.floor(e) for e in exact]
    by_remainder = sorted(range(n), key=lambda r: (exact[r] - math.floor(exact[r]), -r), reverse=True)
    for r in by_remainder[:total - sum(parts)]:
        parts[r] += 1
    return tuple(parts)


def bounded_split(total: int, weights: list[float]) -> tuple[int, ...]:
    """split(), then each share clamped to [MIN_SHARE, MAX_SHARE] x total / n, the excess handed to
    the ranks still inside their bounds in proportion to their weights."""
    n = len(weights)
    equal = total / n
    lo, hi = max(1, math.ceil(MIN_SHARE * equal)), max(1, math.floor(MAX_SHARE * equal))
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        weights = [1.0] * n
    fixed: dict[int, int] = {}
    for _ in range(n):  # each pass fixes at least one more rank at a bound, or ends
        free = [r for r in range(n) if r not in fixed]
        left = total - sum(fixed.values())
        scale = left / sum(weights[r] for r in free)
        ideal = {r: weights[r] * scale for r in free}
        over = {r: hi for r in free if ideal[r] > hi}
        under = {r: lo for r in free if ideal[r] < lo}
        if not over and not under:
            break
        fixed.update(over or under)  # the larger excess first; the rest is recomputed
    free = [r for r in range(n) if r not in fixed]
    parts = dict(fixed)
    if free:
        rest = split(total - sum(fixed.values()), [weights[r] for r in free])
        parts.update(zip(free, rest))
    return tuple(parts[r] for r in range(n))


def plan_for(global_batch: int, world_size: int, per_rank_batch: int) -> tuple[int, int]:
    """(micro_steps, micro_batch) for a global batch on `world_size` ranks, each rank taking at
    most about `per_rank_batch` a micro-batch: the fewest micro-steps that divide the batch."""
    if global_batch < world_size:
        raise ValueError(f"a global batch of {global_batch} cannot feed {world_size} ranks")
    for micro_steps in range(1, global_batch + 1):
        if global_batch % micro_steps == 0:
            micro = global_batch // micro_steps
            if micro <= world_size * per_rank_batch and micro >= world_size:
                return micro_steps, micro
    return global_batch // world_size, world_size  # unreachable for per_rank_batch >= 1


def initial_weights(balance: str, free_memory: list[int | None], speed: list[float | None]) -> tuple[list[float], str]:
    """Per-rank weights for the first shares, and why (a line for the log)."""
    n = len(free_memory)
    if balance == "memory":
        if all(m is not None and m > 0 for m in free_memory) and len(set(free_memory)) > 1:
            gib = ", ".join(f"{m / 2**30:.1f}" for m in free_memory)
            return [float(m) for m in free_memory], f"in proportion to free memory ({gib} GiB)"
        return [1.0] * n, "equal (the devices report the same free memory, or none)"
    if balance == "speed":
        if all(s is not None and s > 0 for s in speed):
            rates = ", ".join(f"{s:,.0f}" for s in speed)
            return [float(s) for s in speed], f"in proportion to measured speed ({rates} samples/s)"
        return [1.0] * n, "equal (speed could not be measured)"
    return [1.0] * n, "equal"


@dataclass(frozen=True)
class BalanceDecision:
    shares: tuple[int, ...]  # new shares (the same tuple when nothing changes)
    imbalance: float | None  # slowest / fastest compute time of the window
    limited_rank: int | None  # still slower than LIMITED_AT x the others at its smallest share
    predicted_imbalance: float | None

    def changed(self, before: tuple[int, ...]) -> bool:
        return self.shares != before


def imbalance(times: list[float]) -> float | None:
    positive = [t for t in times if t > 0]
    if len(positive) < 2 or len(positive) != len(times):
        return None
    return max(times) / min(times)


def smoothed_costs(previous: list[float] | None, shares: tuple[int, ...], times: list[float],
                   keep: float = 0.5) -> list[float] | None:
    """Seconds per sample of each rank, averaged over windows (a share change, a busy neighbour on
    a shared machine: one window's figure is noisy). None until every rank measured something."""
    if any(t <= 0 for t in times):
        return previous
    costs = [t / s for t, s in zip(times, shares)]
    if previous is None:
        return costs
    return [keep * p + (1 - keep) * c for p, c in zip(previous, costs)]


def rebalance(shares: tuple[int, ...], times: list[float], allowed: bool = True,
              slowest_before: int | None = None) -> BalanceDecision:
    """New shares from one window's per-rank compute times (seconds per step at these shares).

    Each rank's speed is shares / time; a rank that stays behind (the slowest in this window and
    the one before, by REBALANCE_AT and MIN_GAP_S) moves the shares to the speeds, bounded. Small
    changes (< MIN_CHANGE) are not made: noise, not skew.
    """
    ratio = imbalance(times)
    if ratio is None:
        return BalanceDecision(shares, None, None, None)
    speeds = [s / t for s, t in zip(shares, times)]
    target = bounded_split(sum(shares), speeds)
    predicted = [s / v for s, v in zip(target, speeds)]
    after = max(predicted) / min(predicted)
    slowest = max(range(len(times)), key=lambda r: predicted[r])
    limited = slowest if after > LIMITED_AT else None
    skewed = ratio > REBALANCE_AT and max(times) - min(times) > MIN_GAP_S and slowest_now(times) == slowest_before
    moves = max(abs(a - b) / b for a, b in zip(target, shares)) >= MIN_CHANGE
    if allowed and skewed and moves:
        return BalanceDecision(target, ratio, limited, after)
    return BalanceDecision(shares, ratio, limited, ratio)


def slowest_now(times: list[float]) -> int:
    return max(range(len(times)), key=lambda r: times[r])

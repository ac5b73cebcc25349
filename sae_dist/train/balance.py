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

A move needs evidence, not a noisy median (see `rebalance`): the straggler's per-step compute
times must sit above the fastest rank's by REBALANCE_AT, quartile against quartile, for
EVIDENCE_WINDOWS report windows running. Moves back need twice that streak, and after MAX_MOVES
moves only an OVERWHELMING_AT gap moves the shares again. Since the shares never change what is
learnt (every source serves a step's samples whatever the shares), a move only costs time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_SHARE = 0.25  # x the equal share
MAX_SHARE = 2.0
REBALANCE_AT = 1.2  # a straggler's lower quartile / the fastest rank's upper quartile, per window
MIN_GAP_S = 0.002  # ...and its median at least this much above the fastest's (jitter on tiny steps)
EVIDENCE_WINDOWS = 3  # windows running in which the same rank must pass REBALANCE_AT
REVERSE_WINDOWS = 6  # ...for a rank that gained share in the last move (hysteresis: no flip-flop)
MAX_MOVES = 3  # moves per run at REBALANCE_AT; after that only at OVERWHELMING_AT
OVERWHELMING_AT = 2.0
MIN_WINDOW_STEPS = 4  # a shorter window (a run's last, a checkpoint's) is no evidence either way
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


def imbalance(times: list[float]) -> float | None:
    positive = [t for t in times if t > 0]
    if len(positive) < 2 or len(positive) != len(times):
        return None
    return max(times) / min(times)


@dataclass(frozen=True)
class WindowTimes:
    """One rank's per-step compute times (data + forward, seconds, at its share) over one report
    window, as quartiles: what each rank all-gathers at a report."""

    low: float  # lower quartile
    median: float
    high: float  # upper quartile
    steps: int

    @classmethod
    def of(cls, times: list[float]) -> WindowTimes:
        if not times:
            return cls(0.0, 0.0, 0.0, 0)
        ordered = sorted(times)
        return cls(_quantile(ordered, 0.25), _quantile(ordered, 0.5), _quantile(ordered, 0.75), len(times))

    def row(self) -> list[float]:
        return [self.low, self.median, self.high, float(self.steps)]

    @classmethod
    def from_row(cls, row: list[float]) -> WindowTimes:
        return cls(float(row[0]), float(row[1]), float(row[2]), int(row[3]))


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), of a sorted list."""
    at = q * (len(ordered) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def slow_ranks(window: list[WindowTimes], at: float = REBALANCE_AT) -> list[int]:
    """The ranks that are slower than the fastest beyond the window's noise: their lower quartile is
    at least `at` x the fastest rank's upper quartile, and their median MIN_GAP_S above its median.
    Empty when a rank measured too few steps (nothing is known) or there is a single rank."""
    if len(window) < 2 or any(w.steps < MIN_WINDOW_STEPS or w.low <= 0 for w in window):
        return []
    fastest = min(range(len(window)), key=lambda r: window[r].median)
    f = window[fastest]
    return [r for r, w in enumerate(window)
            if r != fastest and w.low >= at * f.high and w.median - f.median >= MIN_GAP_S]


@dataclass(frozen=True)
class BalanceState:
    """What the rebalancer remembers between windows; part of the checkpoint, so a resumed run
    decides as the straight one would from the same times."""

    streak: tuple[int, ...]  # per rank: windows running in slow_ranks() at REBALANCE_AT
    strong: tuple[int, ...]  # ...at OVERWHELMING_AT
    gained: tuple[bool, ...]  # per rank: its share grew in the last move
    moves: int  # moves so far in this run
    recent: tuple[tuple[WindowTimes, ...], ...]  # the last REVERSE_WINDOWS windows at the current shares

    @classmethod
    def fresh(cls, world_size: int, moves: int = 0) -> BalanceState:
        return cls((0,) * world_size, (0,) * world_size, (False,) * world_size, moves, ())

    def to_dict(self) -> dict:
        return {"streak": list(self.streak), "strong": list(self.strong), "gained": list(self.gained),
                "moves": self.moves, "recent": [[w.row() for w in window] for window in self.recent]}

    @classmethod
    def from_dict(cls, d: dict | None, world_size: int) -> BalanceState:
        """The saved state; a fresh one (moves kept) when there is none or it was for other ranks."""
        if not d:
            return cls.fresh(world_size)
        if len(d.get("streak", ())) != world_size:
            return cls.fresh(world_size, int(d.get("moves", 0)))
        return cls(tuple(int(v) for v in d["streak"]), tuple(int(v) for v in d["strong"]),
                   tuple(bool(v) for v in d["gained"]), int(d["moves"]),
                   tuple(tuple(WindowTimes.from_row(r) for r in window) for window in d["recent"]))


@dataclass(frozen=True)
class BalanceDecision:
    shares: tuple[int, ...]  # new shares (the same tuple when nothing changes)
    imbalance: float | None  # slowest / fastest median compute time of the window
    limited_rank: int | None  # slower than LIMITED_AT x the others even at its smallest share
    predicted_imbalance: float | None
    state: BalanceState | None = None
    # When the shares move: the rank that triggered it and, per window of its streak, its lower
    # quartile, the fastest rank's upper quartile and their ratio (the figures that passed the rule).
    slow_rank: int | None = None
    evidence: tuple[tuple[float, float, float], ...] = ()
    threshold: float | None = None

    def changed(self, before: tuple[int, ...]) -> bool:
        return self.shares != before

    def describe(self) -> str:
        """Why the shares moved, with the numbers that passed the rule."""
        if self.slow_rank is None:
            return "shares unchanged"
        lows = "/".join(f"{lo * 1000:.1f}" for lo, _, _ in self.evidence)
        highs = "/".join(f"{hi * 1000:.1f}" for _, hi, _ in self.evidence)
        ratios = ", ".join(f"{r:.2f}x" for _, _, r in self.evidence)
        return (f"rank {self.slow_rank} slower for {len(self.evidence)} windows running: its compute time's "
                f"lower quartile {lows} ms vs the fastest rank's upper quartile {highs} ms ({ratios}; "
                f"rule: {self.threshold:g}x in each)")


def rebalance(shares: tuple[int, ...], window: list[WindowTimes], state: BalanceState | None = None,
              allowed: bool = True) -> BalanceDecision:
    """The rebalancer's decision after one report window (`window`: every rank's quartiles of its
    per-step compute times at `shares`).

    Shares move, to each rank in proportion to its speed (share / median time over the streak's
    windows, bounded), only when some rank r is in slow_ranks() for EVIDENCE_WINDOWS windows
    running, or REVERSE_WINDOWS when r gained share in the last move (a move back needs the longer
    streak), and the new shares differ by MIN_CHANGE. After MAX_MOVES moves the streak must be at
    OVERWHELMING_AT. A move restarts every streak: windows at the old shares say nothing about the
    new ones. Windows of fewer than MIN_WINDOW_STEPS steps leave the state as it was.
    """
    n = len(shares)
    state = (state if state is not None and len(state.streak) == n
             else BalanceState.fresh(n, state.moves if state else 0))
    medians = [w.median for w in window]
    ratio = imbalance(medians)
    if ratio is None or any(w.steps < MIN_WINDOW_STEPS for w in window):
        return BalanceDecision(shares, ratio, None, ratio, state)
    slow = set(slow_ranks(window))
    strong = set(slow_ranks(window, OVERWHELMING_AT))
    state = BalanceState(tuple(s + 1 if r in slow else 0 for r, s in enumerate(state.streak)),
                         tuple(s + 1 if r in strong else 0 for r, s in enumerate(state.strong)),
                         state.gained, state.moves, (*state.recent, tuple(window))[-REVERSE_WINDOWS:])

    speeds = [s / t for s, t in zip(shares, medians)]
    target = bounded_split(sum(shares), speeds)
    predicted = [s / v for s, v in zip(target, speeds)]
    after = max(predicted) / min(predicted)
    worst = max(range(n), key=lambda r: predicted[r])
    limited = worst if after > LIMITED_AT and worst in slow else None
    unchanged = BalanceDecision(shares, ratio, limited, after if limited is not None else ratio, state)
    if not allowed:
        return unchanged

    capped = state.moves >= MAX_MOVES
    streaks, threshold = (state.strong, OVERWHELMING_AT) if capped else (state.streak, REBALANCE_AT)
    ready = [r for r in range(n) if streaks[r] >= (REVERSE_WINDOWS if state.gained[r] else EVIDENCE_WINDOWS)]
    if not ready:
        return unchanged
    trigger = max(ready, key=lambda r: medians[r])
    needed = REVERSE_WINDOWS if state.gained[trigger] else EVIDENCE_WINDOWS
    streak = state.recent[-needed:]
    # The speeds of the whole streak (medians of its windows' medians), not of its last window.
    typical = [_quantile(sorted(w[r].median for w in streak), 0.5) for r in range(n)]
    speeds = [s / t for s, t in zip(shares, typical)]
    target = bounded_split(sum(shares), speeds)
    if max(abs(a - b) / b for a, b in zip(target, shares)) < MIN_CHANGE:
        return unchanged  # at its bounds already, or too small a change to be worth a move
    predicted = [s / v for s, v in zip(target, speeds)]
    evidence = []
    for w in streak:
        fastest = min(range(n), key=lambda r: w[r].median)
        evidence.append((w[trigger].low, w[fastest].high, w[trigger].low / w[fastest].high))
    moved = BalanceState((0,) * n, (0,) * n, tuple(a > b for a, b in zip(target, shares)), state.moves + 1, ())
    return BalanceDecision(target, ratio, limited, max(predicted) / min(predicted), moved, trigger,
                           tuple(evidence), threshold)

"""Turning per-rank sums into the numbers a run reports; straggler detection.

Ranks accumulate plain sums between reports and all-reduce them once per report (one small
collective, no per-step synchronisation). Everything here is a pure function of those sums.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

# Layout of the per-rank accumulator that is all-reduced at each report (then sum(x) follows).
SUMS = ("loss", "mse", "x_sq", "l0", "auxk", "sparsity", "samples", "bad_data", "bad_loss")
IDX = {name: i for i, name in enumerate(SUMS)}

STRAGGLER_RATIO = 1.3  # a rank this much slower than the median is a straggler


@dataclass
class WindowMetrics:
    loss: float
    mse: float
    fvu: float
    explained_variance: float
    l0: float
    auxk_loss: float
    sparsity_loss: float
    samples: int
    bad_data: bool
    bad_loss: bool


def window_metrics(sums: torch.Tensor) -> WindowMetrics:
    """Metrics over a report window from the all-reduced accumulator (scalars then sum of x)."""
    s = sums.double().cpu()
    n = max(float(s[IDX["samples"]]), 1.0)
    sum_x = s[len(SUMS):]
    sq_err = float(s[IDX["mse"]])  # accumulated as mse x batch = summed squared error
    total_var = float(s[IDX["x_sq"]]) - float(sum_x.pow(2).sum()) / n
    fvu = sq_err / total_var if total_var > 0 else float("nan")
    return WindowMetrics(
        loss=float(s[IDX["loss"]]) / n,
        mse=sq_err / n,
        fvu=fvu,
        explained_variance=1.0 - fvu,
        l0=float(s[IDX["l0"]]) / n,
        auxk_loss=float(s[IDX["auxk"]]) / n,
        sparsity_loss=float(s[IDX["sparsity"]]) / n,
        samples=int(n),
        bad_data=bool(s[IDX["bad_data"]] > 0),
        bad_loss=bool(s[IDX["bad_loss"]] > 0),
    )


def find_stragglers(times: list[float], ratio: float = STRAGGLER_RATIO, min_gap_s: float = 0.002) -> list[int]:
    """Ranks whose time is well above the median: over `ratio` x median and `min_gap_s` more.

    The absolute gap keeps microsecond jitter on tiny steps from being called a straggler.
    """
    if len(times) < 2:
        return []
    median = statistics.median(times)
    return [r for r, t in enumerate(times) if t > ratio * median and t - median > min_gap_s]

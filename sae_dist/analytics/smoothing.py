"""Exponential smoothing of a curve, exactly as TensorBoard's scalar dashboard does it.

TensorBoard (vz_line_chart2, then the "classic" smoothing of its newer frontend) keeps
`last = last * w + (1 - w) * value`, starting from 0, and divides by `1 - w**n` for the
n-th measured point (its `debiasWeight`), so the first points are not pulled toward 0.
A missing value (None, NaN, ±inf) is shown as missing and does not count in n; a constant
series is returned as it is (TensorBoard's issue #786: float error would make it wobble).

Pure: plain sequences in, a list out; the page decides what to draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MAX_WEIGHT = 0.99
"""The slider's top: at 1 a curve would never move."""


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def ema_debiased(values: Sequence[float | None], weight: float) -> list[float | None]:
    """`values` smoothed with weight `weight` (0 = unchanged) and debiased as TensorBoard does;
    None where the value is missing."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1], got {weight}")
    out: list[float | None] = [v if _finite(v) else None for v in values]
    # Constant as TensorBoard tests it: every value equal to the first (a missing first value,
    # NaN in TensorBoard, equals nothing), so a series with gaps is smoothed.
    if not out or weight == 0.0 or (out[0] is not None and all(v == out[0] for v in values)):
        return out
    last, n = 0.0, 0
    for i, value in enumerate(out):
        if value is None:
            continue
        last = last * weight + (1.0 - weight) * value
        n += 1
        debias = 1.0 - weight ** n if weight != 1.0 else 1.0
        out[i] = last / debias
    return out

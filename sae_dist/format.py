"""How numbers read on the page, in the CLIs and in the reports: a missing value is "—",
never 0; units are spelled out.

The one duration (`fmt_duration`), byte (`fmt_bytes`) and percent (`fmt_percent`, and
`fmt_util` for a reading already in percent) formatter of the project: every page, CLI,
report and script writes these quantities through them, so the same thing reads the same
everywhere. Pure functions of the standard library only (no torch, no Streamlit): a leaf that
every layer may import (the trainer's log lines, the scheduler's CLI, the app, the reports).
"""

from __future__ import annotations

import math
import re
import signal as _signal
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

MISSING = "—"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


MARKDOWN_SPECIAL = set("\\`*_[]<>|~$")


def plain_markdown(text: str) -> str:
    """User text (a job's name) shown as itself in the middle of a Markdown line: each character
    Markdown (and Streamlit's :color[] and $math$) would act on there is escaped."""
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in text)


def fmt_number(value: float | None, digits: int = 4) -> str:
    """`digits` significant digits (thousands separated when large); "—" when missing."""
    if _missing(value):
        return MISSING
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_percent(value: float | None, decimals: int = 1) -> str:
    """A fraction (0.25) as a percentage with `decimals` decimals ("25.0%"); "—" when missing."""
    return MISSING if _missing(value) else f"{100 * value:.{decimals}f}%"


def fmt_bytes(value: int | float | None) -> str:
    """Bytes in binary units, one decimal past bytes: "512 B", "88.0 MiB", "3.1 GiB",
    "3.0 TiB"; "—" when not measured."""
    if _missing(value):
        return MISSING
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def fmt_seconds(value: float | None) -> str:
    """A short duration (step times): ms under a second; "—" when missing."""
    if _missing(value):
        return MISSING
    return f"{1000 * value:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"


def fmt_ago(seconds: float | None) -> str:
    """How long ago, coarsely ("12 s ago", "3 min ago", "2 h ago"); "—" when unknown."""
    if _missing(seconds):
        return MISSING
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def fmt_time(moment: datetime | None) -> str:
    """An aware datetime as UTC to the second; "—" when unknown."""
    return MISSING if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_steps(last_step: int | None, total_steps: int | None) -> str:
    """"150 / 300"; "—" for an unknown part."""
    last = MISSING if last_step is None else f"{last_step:,}"
    total = MISSING if total_steps is None else f"{total_steps:,}"
    return f"{last} / {total}"


def short_device(device: str, uuid_chars: int = 8) -> str:
    """A device label for a cell, a legend or a caption: a GPU UUID cut to its first
    `uuid_chars` hex digits ("GPU-5f3a2b1c", enough to tell a machine's GPUs apart, and what
    `nvidia-smi -L` starts with); "cpu:0" as it is."""
    return device[: 4 + uuid_chars] if device.startswith("GPU-") else device


def short_devices(devices: list[str], uuid_chars: int = 8) -> str:
    """`short_device` of each, comma-separated; "—" when none is recorded."""
    return ", ".join(short_device(d, uuid_chars) for d in devices) or MISSING


def fmt_duration(seconds: float | None) -> str:
    """A longer duration (elapsed, ETA, time limit): "45 s", "3 min 05 s", "2 h 07 min",
    "1 d 04 h"; "—" when unknown."""
    if _missing(seconds):
        return MISSING
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600:02d} h"


def fmt_celsius(value: float | None) -> str:
    """A temperature: "64 °C"; "—" when not measured (a virtual device has none)."""
    return MISSING if _missing(value) else f"{value:.0f} °C"


def fmt_watts(value: float | None, limit: float | None = None) -> str:
    """Power draw: "212 W", or "212 / 300 W" with the card's limit; "—" when not measured."""
    if _missing(value):
        return MISSING
    return f"{value:.0f} W" if _missing(limit) else f"{value:.0f} / {limit:.0f} W"


def fmt_util(value: float | None) -> str:
    """A reading already in percent (0 to 100: a device's utilisation, other processes' CPU in
    percent of one core) as a whole percentage: "37%"; "—" when not measured."""
    return MISSING if _missing(value) else f"{value:.0f}%"


def memory_fraction(used: int | None, total: int | None) -> float | None:
    """used / total clipped to 0..1, for a memory bar; None when either is unknown."""
    if _missing(used) or _missing(total) or not total:
        return None
    return min(1.0, max(0.0, used / total))


def fmt_memory_of(used: int | None, total: int | None) -> str:
    """"1.2 GiB / 80.0 GiB"; an unknown side reads "—"."""
    return f"{fmt_bytes(used)} / {fmt_bytes(total)}"


def fmt_signal(number: int) -> str:
    """"signal 15 (SIGTERM)"; a number this system has no name for reads "signal 77"."""
    try:
        return f"signal {number} ({_signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def fmt_exit(exit_code: int | None, signal: int | None) -> str:
    """A job's end in one format for every table and header: "0", "1", "signal 15 (SIGTERM)",
    and "143 · signal 15 (SIGTERM)" for an exit status of 128 + N (a launcher or shell
    reporting that its child died of signal N); "—" when nothing was recorded."""
    if signal:
        return fmt_signal(signal)
    if exit_code is None:
        return MISSING
    if 128 < exit_code < 128 + 65:
        return f"{exit_code} · {fmt_signal(exit_code - 128)}"
    return str(exit_code)


# A training run's status as a badge colour (the trainer writes RUNNING, COMPLETED, FAILED, and
# STOPPED when a signal ended it: a cancel, a time limit, Ctrl-C).
RUN_STATUS_COLORS = {"RUNNING": "blue", "COMPLETED": "green", "FAILED": "red", "STOPPED": "orange"}


# ---- load balance: shares, imbalance, run events --------------------------------------------

EVENT_LABELS = {"rebalance": "rebalanced", "balance_limited": "balance limited",
                "degraded": "continued on fewer devices"}
"""How a run event's kind (run_events.kind) reads on the page."""


def event_label(kind: str) -> str:
    """A run event's kind for people; an unknown kind (a newer trainer) reads as itself."""
    return EVENT_LABELS.get(kind, kind)


def fmt_ratio(value: float | None) -> str:
    """A ratio such as the imbalance (slowest / fastest): "1.42×"; "—" when not measured."""
    return MISSING if _missing(value) else f"{value:.2f}×"


def fmt_share(batch_size: int | None, total: int | None = None) -> str:
    """A rank's samples per step, with its part of the global batch when known: "384 (75%)"."""
    if _missing(batch_size):
        return MISSING
    if _missing(total) or not total:
        return f"{batch_size:,}"
    return f"{batch_size:,} ({batch_size / total:.0%})"


def balance_limited_message(rank: int, slowdown: float | None) -> str:
    """The warning for a rank that rebalancing cannot even out; the factor only when measured."""
    how_slow = (f"stay {slowdown:.1f} times slower than the fastest" if not _missing(slowdown)
                else "stay slower than the fastest")
    return (f"Rank {rank}'s steps {how_slow} even at its smallest share: rebalancing cannot "
            "even it out. Give the run devices of a kind, or leave this one out.")


def balance_limited_slowdown(rank: int, events: list[dict[str, Any]],
                             window: list[dict[str, Any]]) -> float | None:
    """How many times slower than the fastest the balance-limited `rank` is: the newest
    "balance_limited" event's figure for it, else its compute time over the fastest rank's in
    the latest window (`queries.latest_rank_window`) when it is the slowest there; None when
    neither was measured."""
    for event in reversed(events):
        details = event.get("details") or {}
        if event["kind"] == "balance_limited" and details.get("rank") == rank:
            if not _missing(details.get("slowdown")):
                return float(details["slowdown"])
    times = {w["rank"]: w["compute_time_s"] for w in window if not _missing(w["compute_time_s"])}
    if rank not in times or min(times.values()) <= 0 or times[rank] < max(times.values()):
        return None
    return times[rank] / min(times.values())


def event_lines(events: list[dict[str, Any]], limit: int = 10) -> list[str]:
    """The newest `limit` run events as markdown list items, newest first, and a last line
    counting the older ones left out."""
    shown = events[::-1][:limit]
    lines = [f"- step {e['step']:,} · **{event_label(e['kind'])}** · {e['message']}" for e in shown]
    if len(events) > limit:
        lines.append(f"- … and {len(events) - limit:,} earlier")
    return lines


# ---- numbers as Vega-Lite writes them ---------------------------------------------------------

_D3_SPEC = re.compile(r"^(?P<comma>,)?(?:\.(?P<precision>\d+))?(?P<trim>~)?(?P<type>[fgde%])$")
D3_MINUS = "\u2212"  # d3-format's minus sign


def fmt_d3(value: float | None, spec: str) -> str:
    """`value` formatted as the d3-format `spec` of a chart's tooltip or axis writes it, so that
    a card beside a chart reads exactly as the chart's own tooltip; "—" when missing.

    The subset the app's charts use: an optional "," (thousands), ".N" precision, "~" (trim
    insignificant zeros) and a type among f, g, d, e, %. Rounding as JavaScript's toFixed and
    toPrecision (ties away from zero), exponents as d3 writes them ("1.5e-7", "2e+21"); checked
    against Node's toFixed, toPrecision and toExponential for magnitudes under 1e21 (where
    JavaScript's toFixed turns exponential and this does not)."""
    match = _D3_SPEC.match(spec)
    if match is None:
        raise ValueError(f"unsupported d3 format {spec!r}")
    if _missing(value):
        return MISSING
    kind, trim, comma = match["type"], bool(match["trim"]), bool(match["comma"])
    precision = None if match["precision"] is None else int(match["precision"])
    negative = value < 0
    # Exact decimals of the float JavaScript holds; a percentage is multiplied in floating
    # point first, as d3 does.
    x = abs(Decimal(value * 100 if kind == "%" else value))
    if kind in ("f", "%"):
        text = _to_fixed(x, 6 if precision is None else precision)
    elif kind == "d":  # Math.round: ties towards +infinity
        text = f"{abs(math.floor(value + 0.5))}"
        negative = math.floor(value + 0.5) < 0
    elif kind == "e":
        text = _to_exponential(x, 6 if precision is None else precision)
    else:
        text = _to_precision(x, 6 if precision is None else max(1, precision))
    if trim:
        text = _trim(text)
    if comma:
        head, dot, tail = text.partition(".")
        if "e" not in head:
            head = f"{int(head):,}"
        text = head + dot + tail
    if negative and any(c not in "0.,e+-" for c in text.split("e")[0]):
        text = D3_MINUS + text  # d3 drops the sign of a value that rounds to zero
    return text + ("%" if kind == "%" else "")


def _to_fixed(x: Decimal, digits: int) -> str:
    return f"{x.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP):f}"


def _exponent(x: Decimal, significant: int) -> tuple[Decimal, int]:
    """x rounded to `significant` digits, and the exponent of its leading digit after rounding."""
    if x == 0:
        return x, 0
    e = x.adjusted()
    rounded = x.quantize(Decimal(1).scaleb(e - significant + 1), rounding=ROUND_HALF_UP)
    return rounded, rounded.adjusted()


def _to_exponential(x: Decimal, digits: int) -> str:
    rounded, e = _exponent(x, digits + 1)
    mantissa = _to_fixed(rounded.scaleb(-e), digits)
    return f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def _to_precision(x: Decimal, significant: int) -> str:
    rounded, e = _exponent(x, significant)
    if e < -6 or e >= significant:
        return _to_exponential(x, significant - 1)
    return _to_fixed(rounded, max(0, significant - 1 - e))


def _trim(text: str) -> str:
    mantissa, e, exponent = text.partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return mantissa + e + exponent

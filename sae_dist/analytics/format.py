"""How numbers read on the page: a missing value is "—", never 0; units are spelled out.

Pure functions (no Streamlit), so the table the app shows is testable with plain data.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

MISSING = "—"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def fmt_number(value: float | None, digits: int = 4) -> str:
    """`digits` significant digits (thousands separated when large); "—" when missing."""
    if _missing(value):
        return MISSING
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_percent(value: float | None, decimals: int = 1) -> str:
    """A fraction as a percentage; "—" when missing."""
    return MISSING if _missing(value) else f"{100 * value:.{decimals}f}%"


def fmt_bytes(value: int | None) -> str:
    """Bytes in binary units (MiB, GiB); "—" when not measured."""
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


def short_devices(devices: list[str], uuid_chars: int = 8) -> str:
    """Device labels for a table cell: GPU UUIDs cut to their first `uuid_chars` hex digits
    (enough to tell a machine's GPUs apart); "—" when none is recorded."""
    short = [d[: 4 + uuid_chars] if d.startswith("GPU-") else d for d in devices]
    return ", ".join(short) or MISSING


def runs_table(runs: list[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """The overview's table rows from `queries.list_runs` summaries (one dict per run).

    Numbers are pre-formatted strings so that a missing one reads "—"; progress stays a
    fraction (or None) for a progress-bar column; started stays a datetime.
    """
    rows = []
    for run in runs:
        updated = run["last_update"]
        rows.append({  # the columns people scan first come first
            "id": run["id"],
            "name": run["name"],
            "status": run["status"],
            "steps": fmt_steps(run["last_step"], run["total_steps"]),
            "progress": run["progress"],
            "FVU": fmt_number(run["fvu"]),
            "L0": fmt_number(run["l0"], 3),
            "samples/s": fmt_number(run["samples_per_s"], 3),
            "world size": run["world_size"],
            "backend": run["backend"],
            "devices": short_devices(run["devices"]),
            "started": run["started_at"],
            "last update": fmt_ago(None if updated is None else (now - updated).total_seconds()),
        })
    return rows

"""How a device reads on the page: its state badge, its card, whether a job may be put on it.

Pure functions of the plain device rows that `scheduler.status.device_rows` returns (this
package never imports the scheduler): index, uuid, name, label, virtual, state (idle /
allocated / busy / unavailable), job_id, reason, error, memory_total / used / free,
utilization_pct, temperature_c, power_w, power_limit_w. A reading that is None was not
measured and reads "—", never 0.
"""

from __future__ import annotations

from typing import Any

from sae_dist.format import (
    MISSING,
    fmt_bytes,
    fmt_celsius,
    fmt_memory_of,
    fmt_util,
    fmt_watts,
    memory_fraction,
)

STATE_COLORS = {"idle": "green", "allocated": "blue", "busy": "orange", "unavailable": "red"}
VIRTUAL_HELP = ("CPU-backed device: one training rank on this machine's CPU (gloo). Its memory "
                "is a share of the machine's RAM; it has no temperature or power reading.")


def state_badge(row: dict[str, Any]) -> tuple[str, str, str]:
    """(label, color, explanation) of a device's state: "idle", "job N", "busy external" or
    "unavailable"."""
    state = row["state"]
    if state == "allocated" and row.get("sharers"):
        return shared_badge(row)
    if state == "allocated":
        return f"job {row['job_id']}", STATE_COLORS[state], row.get("reason") or f"job {row['job_id']}"
    if state == "busy":
        return "busy external", STATE_COLORS[state], f"used by something else: {row.get('reason')}"
    if state == "unavailable":
        return "unavailable", STATE_COLORS[state], row.get("reason") or row.get("error") or "cannot be read"
    return "idle", STATE_COLORS["idle"], "free: no job and no other process on it"


def shared_badge(row: dict[str, Any]) -> tuple[str, str, str]:
    """A device shared by `submit --shared` jobs: their ids; the help lists each one's declared
    memory (and what it uses when over it) and the memory left to declare."""
    sharers = row["sharers"]
    over = [s for s in sharers if s.get("over")]
    label = f"shared · job{'s' if len(sharers) > 1 else ''} {', '.join(str(s['job']) for s in sharers)}"
    parts = [f"job {s['job']}: {fmt_bytes(s['declared'])} declared"
             + (f", uses {fmt_bytes(s['used'])} (over)" if s.get("over") else "") for s in sharers]
    left = row["memory_total"] - sum(s["declared"] or 0 for s in sharers) if row.get("memory_total") else None
    help_text = "; ".join(parts) + (f"; {fmt_bytes(left)} left to declare" if left is not None else "")
    return (label + (" · OVER" if over else ""), "red" if over else STATE_COLORS["allocated"], help_text)


def card(row: dict[str, Any]) -> dict[str, Any]:
    """What a device card shows: title, virtual, badge (label, color, help), memory and
    utilisation bars (fraction, None when unknown, and text), temperature, power."""
    return {
        "title": f"{row['index']} · {row['name']}",
        "virtual": bool(row["virtual"]),
        "badge": state_badge(row),
        "memory_fraction": memory_fraction(row["memory_used"], row["memory_total"]),
        "memory_text": fmt_memory_of(row["memory_used"], row["memory_total"]),
        "utilization": fmt_util(row["utilization_pct"]),
        "utilization_fraction": (None if row["utilization_pct"] is None
                                 else min(1.0, max(0.0, row["utilization_pct"] / 100))),
        "temperature": fmt_celsius(row["temperature_c"]),
        "power": fmt_watts(row["power_w"], row.get("power_limit_w")),
    }


def why_not_selectable(row: dict[str, Any]) -> str | None:
    """Why a job cannot be put on this device now (allocated, busy, unavailable); None when
    it can (idle)."""
    state = row["state"]
    if state == "allocated":
        return f"allocated to job {row['job_id']}"
    if state == "busy":
        return f"busy: {row.get('reason')}"
    if state == "unavailable":
        return f"unavailable: {row.get('reason') or row.get('error') or 'cannot be read'}"
    return None


def low_memory(row: dict[str, Any], need_bytes: int | None) -> str | None:
    """"low memory: X free, Y needed" when the device's free memory is short of the estimate;
    None when it fits, or when either figure is unknown."""
    free = row.get("memory_free")
    if need_bytes is None or free is None or free >= need_bytes:
        return None
    return f"low memory: {fmt_bytes(free)} free, {fmt_bytes(need_bytes)} needed"


def selection_rows(rows: list[dict[str, Any]], need_bytes: int | None,
                   recommended: list[str]) -> list[dict[str, Any]]:
    """The Train page's device table: per device its row plus selectable (bool), why (not
    selectable, or low memory, or ""), low_memory (bool), recommended (bool), and the
    formatted memory "free / total" and utilisation."""
    out = []
    for row in rows:
        blocked = why_not_selectable(row)
        short = None if blocked else low_memory(row, need_bytes)  # taken: memory is not the point
        label, color, _ = state_badge(row)
        out.append({
            **row,
            "selectable": blocked is None,
            "why": blocked or short or "",
            "low_memory": short is not None,
            "recommended": row["uuid"] in recommended,
            "state_label": label, "state_color": color,
            "memory_text": (f"{fmt_bytes(row['memory_free'])} free / {fmt_bytes(row['memory_total'])}"
                            if row.get("memory_total") is not None else MISSING),
            "utilization": fmt_util(row["utilization_pct"]),
        })
    return out

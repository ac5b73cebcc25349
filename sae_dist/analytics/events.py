"""Run events (rebalanced, balance limited, continued on fewer devices) grouped for a chart.

A run that rebalances often records dozens of events; one vertical rule each buried the
curves they sat on. Here events are grouped by step range so that a chart draws at most
`MAX_EVENT_MARKS` marks however many there are: each group is one mark with its count and
a listing for the tooltip. Pure functions on `queries.run_events` rows.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from sae_dist.format import event_label

MAX_EVENT_MARKS = 20
"""Marks a chart's event layer draws at most."""

MAX_LISTED = 6
"""Events a group's tooltip names one by one; the others are counted."""

SEVERITY = ("degraded", "balance_limited", "rebalance")
"""Which kind a mixed group is coloured as: the first of these it holds (else its first kind)."""


def group_events(events: list[dict[str, Any]] | None, max_marks: int = MAX_EVENT_MARKS,
                 max_listed: int = MAX_LISTED) -> list[dict[str, Any]]:
    """`events` ({"step", "kind", "message", ...}) as at most `max_marks` groups, in step order.

    Events at one step are always one group. When there are more distinct steps than
    `max_marks`, the steps from the first event's to the last one's are cut into `max_marks`
    equal ranges and each range holding events is a group. A group: "step" (its first
    event's, where the mark is drawn), "start" and "end" (its first and last steps),
    "count", "kind" (the kind it is coloured as, see SEVERITY), "kinds" ("rebalanced ×3,
    balance limited"), "listing" (its first `max_listed` events, "and N more")."""
    if max_marks < 1:
        raise ValueError(f"max_marks must be at least 1, got {max_marks}")
    chosen = sorted(events or [], key=lambda e: e["step"])
    if not chosen:
        return []
    steps = sorted({e["step"] for e in chosen})
    if len(steps) <= max_marks:
        key = {s: i for i, s in enumerate(steps)}
    else:
        first, last = steps[0], steps[-1]
        width = max(1, math.ceil((last - first + 1) / max_marks))
        key = {s: (s - first) // width for s in steps}
    groups: dict[int, list[dict[str, Any]]] = {}
    for event in chosen:
        groups.setdefault(key[event["step"]], []).append(event)
    return [_group(members, max_listed) for _, members in sorted(groups.items())]


def _group(members: list[dict[str, Any]], max_listed: int) -> dict[str, Any]:
    counts = Counter(e["kind"] for e in members)
    kind = next((k for k in SEVERITY if k in counts), members[0]["kind"])
    kinds = kinds_text(members)
    listed = [f"step {e['step']:,} {event_label(e['kind'])}: {e['message']}"
              for e in members[:max_listed]]
    if len(members) > max_listed:
        listed.append(f"and {len(members) - max_listed:,} more")
    return {"step": members[0]["step"], "start": members[0]["step"], "end": members[-1]["step"],
            "count": len(members), "kind": kind, "kinds": kinds, "listing": "; ".join(listed)}


def kinds_text(events: list[dict[str, Any]] | None) -> str:
    """"rebalanced ×44, balance limited ×2": each kind with its count when several, in the
    order they first happened; "" without events."""
    counts = Counter(e["kind"] for e in events or [])
    return ", ".join(event_label(k) + (f" ×{n}" if n > 1 else "") for k, n in counts.items())


def events_summary(events: list[dict[str, Any]] | None) -> str | None:
    """"46 run events: rebalanced ×44, balance limited ×2"; None without events."""
    if not events:
        return None
    return f"{len(events):,} run event{'s' if len(events) != 1 else ''}: {kinds_text(events)}"

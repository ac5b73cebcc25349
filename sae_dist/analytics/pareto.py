"""L0 against FVU over all runs: each run's final point, where it was measured, and the Pareto
frontier (fewer active latents and less variance unexplained are both better).

Pure functions of plain data: run summaries (`queries.list_runs`) and latest evaluations
(`queries.latest_evaluations`). A run's point is its latest evaluation when that measured
both figures (on rows never trained on), else its last logged training step; the point
says which, since the two are not measured on the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SELECTION = "open_run"
"""The name of the chart's click selection (its field: "run", the run id)."""

FROM_EVALUATION = "evaluation"
FROM_TRAINING = "last training step"


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _measured_on(run: dict[str, Any], evaluation: dict[str, Any] | None) -> str:
    if evaluation is not None:
        rows = evaluation.get("rows")
        where = "held-out rows" if evaluation.get("origin") == "heldout" else "rows given to evaluate"
        return f"evaluation on {rows:,} {where}" if rows else f"evaluation on {where}"
    which = "final step" if run.get("final") else "latest logged step"
    return f"training, {which}" + (f" ({run['last_step']:,})" if run.get("last_step") else "")


def run_points(runs: Sequence[dict[str, Any]],
               evaluations: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per run that has both figures: {"run", "name", "status", "l0", "fvu",
    "source" (FROM_EVALUATION or FROM_TRAINING), "measured_on" (a phrase)}, in run id order.
    Runs with neither an evaluation nor training figures have no point."""
    points = []
    for run in sorted(runs, key=lambda r: r["id"]):
        ev = evaluations.get(run["id"])
        if ev is not None and _number(ev.get("l0")) is not None and _number(ev.get("fvu")) is not None:
            l0, fvu, source = _number(ev["l0"]), _number(ev["fvu"]), FROM_EVALUATION
        else:
            ev = None
            l0, fvu, source = _number(run.get("l0")), _number(run.get("fvu")), FROM_TRAINING
        if l0 is None or fvu is None:
            continue
        points.append({"run": run["id"], "name": run["name"], "status": run.get("status"),
                       "l0": l0, "fvu": fvu, "source": source,
                       "measured_on": _measured_on(run, ev)})
    return points


def caption(points: Sequence[dict[str, Any]], runs_read: int, limit: int) -> str:
    """What the chart shows, said plainly: where the points were measured, which runs have none,
    and that only the newest `limit` runs were read when there may be more."""
    text = ("Each run's point: its latest evaluation where it measured both L0 and FVU (rows never "
            "trained on), else its last logged training step; the marker's shape says which")
    sources = {p["source"] for p in points}
    text += ", and the two are not measured on the same rows." if len(sources) > 1 else "."
    missing = runs_read - len(points)
    if missing:
        text += f" {missing:,} run{'s have' if missing > 1 else ' has'} no point (L0 or FVU never measured)."
    if runs_read >= limit:
        text += f" The newest {limit:,} runs only."
    return text


def pareto_frontier(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats (another with L0 and FVU both no higher and one of them
    lower), by increasing L0. Identical points are all on it; points missing a figure are not."""
    present = [p for p in points if _number(p.get("l0")) is not None and _number(p.get("fvu")) is not None]
    frontier: list[dict[str, Any]] = []
    best_fvu = math.inf
    for p in sorted(present, key=lambda p: (p["l0"], p["fvu"])):
        # Sorted by L0 then FVU, a point is beaten only by one before it with no higher FVU.
        if p["fvu"] < best_fvu:
            frontier.append(p)
            best_fvu = p["fvu"]
        elif frontier and p["fvu"] == best_fvu and p["l0"] == frontier[-1]["l0"]:
            frontier.append(p)  # the same point as the last one kept
    return frontier


def picked_run(state: Any) -> int | None:
    """The run id clicked in the chart, from `st.altair_chart`'s selection state
    ({"selection": {SELECTION: [{"run": id}, ...]}}); None when nothing is selected."""
    if not isinstance(state, dict):
        try:
            state = dict(state)
        except (TypeError, ValueError):
            return None
    picked = (state.get("selection") or {}).get(SELECTION) or []
    if isinstance(picked, dict):  # Vega's empty selection
        picked = [picked] if "run" in picked else []
    for item in picked:
        if isinstance(item, dict) and item.get("run") is not None:
            return int(item["run"])
    return None

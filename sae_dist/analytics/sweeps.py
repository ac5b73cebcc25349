"""The Sweeps page's data: every sweep with its SAEs' progress, and one sweep's grid (each swept
setting a column beside the SAE's final figures), its L0-FVU Pareto plot and its curves.

A sweep's SAEs are ordinary training runs naming it (`training_runs.sweep_id`), so their
figures come from the same summaries, evaluations and step metrics as any run's
(`queries`); the plot and the overlaid curves are the Training runs page's (`pareto`,
`run_compare`, `compare_charts`). Queries return plain data; the shaping is pure.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import altair as alt
from sqlalchemy import and_, func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.analytics import compare_charts, pareto, queries, run_compare
from sae_dist.db.schema import StepMetric, Sweep, TrainingRun
from sae_dist.format import MISSING

DONE, ACTIVE, FAILED = ("COMPLETED",), ("RUNNING", "PENDING"), ("FAILED",)
"""Run statuses counted as done, running and failed; any other (STOPPED, ...) as stopped."""


# ---- queries ----


def list_sweeps(engine: Engine, limit: int = 200) -> list[dict[str, Any]]:
    """The newest `limit` sweeps, newest first: the sweep's row as plain data ("keys" parsed)
    and "counts": how many of its SAEs' runs are in each status ({} before any started)."""
    with engine.connect() as conn:
        sweeps = conn.execute(select(Sweep).order_by(Sweep.id.desc()).limit(limit)).mappings().all()
        ids = [s["id"] for s in sweeps]
        counts: dict[int, dict[str, int]] = {i: {} for i in ids}
        if ids:
            query = (select(TrainingRun.sweep_id, TrainingRun.status, func.count())
                     .where(TrainingRun.sweep_id.in_(ids)).group_by(TrainingRun.sweep_id, TrainingRun.status))
            for sweep_id, status, count in conn.execute(query):
                counts[sweep_id][status] = count
    return [{**_sweep(row), "counts": counts[row["id"]]} for row in sweeps]


def load_sweep(engine: Engine, sweep_id: int) -> dict[str, Any] | None:
    """One sweep as plain data ("keys", "config", "placement" parsed) with "runs": its SAEs'
    run summaries (queries' keys, "config" and "point" included), in the sweep's order."""
    with engine.connect() as conn:
        row = conn.execute(select(Sweep).where(Sweep.id == sweep_id)).mappings().first()
    if row is None:
        return None
    # Every SAE with its latest logged step in one query (256 summaries one by one took 1.6 s),
    # shaped as queries shapes any run's summary, so the Training runs page's figures agree.
    latest_step = (select(func.max(StepMetric.step)).where(StepMetric.run_id == TrainingRun.id)
                   .correlate(TrainingRun).scalar_subquery())
    query = (select(TrainingRun, StepMetric)
             .outerjoin(StepMetric, and_(StepMetric.run_id == TrainingRun.id, StepMetric.step == latest_step))
             .where(TrainingRun.sweep_id == sweep_id).order_by(TrainingRun.id))
    with Session(engine) as session:
        runs = [{**queries.summarize_run(run, latest, with_config=True), "point": run.sweep_point or run.name}
                for run, latest in session.execute(query).all()]
    return {**_sweep(row), "runs": runs}


def _sweep(row: Any) -> dict[str, Any]:
    sweep = dict(row)
    sweep["keys"] = _json(sweep.pop("keys_json"), [])
    sweep["config"] = _json(sweep.pop("config_json"), {})
    sweep["placement"] = _json(sweep.pop("placement_json"), None)
    return sweep


def _json(text: str | None, default: Any) -> Any:
    try:
        return json.loads(text) if text else default
    except ValueError:
        return default


# ---- shaping (pure) ----


def progress_counts(counts: dict[str, int]) -> dict[str, int]:
    """A sweep's SAEs by outcome: {"done", "running", "failed", "stopped"}."""
    out = {"done": 0, "running": 0, "failed": 0, "stopped": 0}
    for status, count in counts.items():
        which = "done" if status in DONE else "running" if status in ACTIVE else \
            "failed" if status in FAILED else "stopped"
        out[which] += count
    return out


def utc_text(when: datetime | None) -> str:
    """A time as the app writes one: 24-hour UTC (the database's times are UTC)."""
    if when is None:
        return MISSING
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def list_rows(sweeps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The list of sweeps as table rows: id, name, status, what it sweeps, SAEs by outcome, job."""
    rows = []
    for s in sweeps:
        c = progress_counts(s["counts"])
        rows.append({"Sweep": s["id"], "Name": s["name"], "Status": s["status"], "Swept": ", ".join(s["keys"]),
                     "SAEs": sum(s["counts"].values()), "Done": c["done"], "Running": c["running"],
                     "Failed": c["failed"], "Job": s["job_id"], "Started (UTC)": utc_text(s["created_at"]),
                     "Finished (UTC)": utc_text(s["finished_at"])})
    return rows


def grid_rows(keys: Sequence[str], runs: Sequence[dict[str, Any]], evaluations: dict[int, dict[str, Any]],
              colors: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """One row per SAE: its point, its colour's swatch when `colors` (`sae_colors`) gives it
    one, each swept setting (from its own config), its L0 and FVU as the Pareto plot takes them
    (the evaluation where it measured both, else the last logged step: "Measured on" says
    which), its dead fraction and status. Unknown stays None."""
    points = {p["run"]: p for p in pareto.run_points(runs, evaluations)}
    rows = []
    for run in runs:
        point = points.get(run["id"], {})
        config = run.get("config") or {}
        row = {"Run": run["id"], "SAE": run["point"]}
        if colors is not None:
            row["Colour"] = swatch(colors[run["id"]]) if run["id"] in colors else None
        row.update({key: config.get(key) for key in keys})
        row.update({"FVU": point.get("fvu"), "L0": point.get("l0"), "Dead fraction": run.get("dead_fraction"),
                    "Status": run["status"], "Measured on": point.get("measured_on", MISSING)})
        rows.append(row)
    return rows


def sweep_points(runs: Sequence[dict[str, Any]], evaluations: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The Pareto plot's points, named by the SAE's point name rather than the run's."""
    names = {run["id"]: run["point"] for run in runs}
    return [{**p, "name": names[p["run"]]} for p in pareto.run_points(runs, evaluations)]


def pareto_chart(points: Sequence[dict[str, Any]], colors: dict[int, str]) -> alt.LayerChart | None:
    """L0 against FVU of the sweep's SAEs, each in its curves' colour (`sae_colors`; grey when
    its curves are not overlaid), with the frontier."""
    chart = compare_charts.pareto_chart(points, pareto.pareto_frontier(points), colors)
    if chart is None:
        return None
    return chart.properties(title=alt.TitleParams(
        "L0 against FVU, the sweep's SAEs",
        subtitle="lower left is better · dashed: the Pareto frontier · click a point to open its run"))


def labelled(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs named by their point in the curves' key and tooltips ("12 · k32-x16")."""
    return [{**run, "name": run["point"]} for run in runs]


MAX_CURVES = 16  # SAEs overlaid at most: past this the charts are a tangle and the page slows
# Tableau 10, then six lighter hues: MAX_CURVES overlaid SAEs, no two of one colour.
SAE_PALETTE = (*run_compare.PALETTE, "#9ecae9", "#ffbf79", "#88d27a", "#ff9d98", "#d6a5c9", "#439894")


def curve_runs(runs: Sequence[dict[str, Any]], points: Sequence[dict[str, Any]],
               limit: int = MAX_CURVES) -> tuple[list[dict[str, Any]], str | None]:
    """The SAEs whose curves are overlaid, and a note saying which when not all of them: every
    one up to `limit`; past it the Pareto frontier's first (by L0), then the lowest FVU, then
    those with no point yet, in the sweep's order (run id) within each part."""
    if len(runs) <= limit:
        return list(runs), None
    frontier = [p["run"] for p in pareto.pareto_frontier(points)]
    by_fvu = [p["run"] for p in sorted(points, key=lambda p: (p["fvu"], p["run"]))]
    order = list(dict.fromkeys([*frontier, *by_fvu, *(r["id"] for r in runs)]))[:limit]
    kept = set(order)
    shown = [r for r in runs if r["id"] in kept]
    return shown, (f"{len(shown)} of {len(runs):,} SAEs' curves shown: the Pareto frontier's "
                   f"({min(len(frontier), limit)}), then the lowest FVU. Each SAE's own curves: its run page.")


def sae_colors(shown: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Each SAE's one colour on every chart and table of the page, by run id: the SAEs whose
    curves are overlaid (`curve_runs`) in the sweep's order. The others have none, so a colour
    never names two SAEs (the Pareto plot draws them grey, the grid shows no swatch)."""
    return run_compare.run_colors([r["id"] for r in shown], SAE_PALETTE)


def swatch(color: str) -> str:
    """A square of `color` as an image the grid's image column draws (an SVG data URL)."""
    svg = (f"<svg xmlns='http://www.w3.org/2000/svg' width='12' height='12'>"
           f"<rect width='12' height='12' fill='{color}'/></svg>")
    return "data:image/svg+xml;utf8," + quote(svg)

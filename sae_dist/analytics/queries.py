"""Read-only queries for the app: training runs, their step metrics and per-rank stats,
benchmarks and their points.

Each function takes an engine and returns plain data (dicts, lists): nothing here imports
Streamlit or the scheduler, and nothing writes. Missing numbers stay None all the way to
the page, which shows them as "—": a value that was not measured is never shown as 0.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.schema import BenchmarkPoint, BenchmarkRun, RankStat, RunEvent, SaeEvaluation, StepMetric, TrainingRun
from sae_dist.errors import UserError

CURVE_METRICS = ("loss", "fvu", "l0", "dead_fraction")
"""The step metrics drawn as training curves, in display order."""

LATEST_METRICS = ("loss", "fvu", "l0", "dead_fraction", "samples_per_s")
"""The metrics a run summary carries: the final value, else the latest logged one."""

RANK_STAT_COLUMNS = ("step", "rank", "device", "step_time_s", "compute_time_s",
                     "peak_memory_bytes", "is_straggler", "batch_size")

WINDOW_COLUMNS = ("step", "rank", "device", "batch_size", "step_time_s", "compute_time_s",
                  "is_straggler")
"""A rank's report window as `rank_windows` and `latest_rank_window` return it; batch_size
(the rank's share of each step) is None on runs from before shares were recorded."""

_STEP_METRIC_NAMES = frozenset(StepMetric.__table__.columns.keys()) - {"id", "run_id"}


def list_runs(engine: Engine, limit: int = 200) -> list[dict[str, Any]]:
    """The newest `limit` training runs, newest first, as run summaries (see `summarize_run`)."""
    return _summaries(engine, None, limit)


def get_run_summary(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """One run's summary, with its parsed config under "config"; None if there is no such run."""
    rows = _summaries(engine, run_id, 1)
    return rows[0] if rows else None


def run_step_metrics(engine: Engine, run_id: int,
                     metrics: tuple[str, ...] = CURVE_METRICS) -> dict[str, list]:
    """One run's logged steps, column-wise: {"step": [...], metric: [...], ...} in step order.

    Values the trainer did not log (or logged as NaN) are None.
    """
    unknown = sorted(set(metrics) - _STEP_METRIC_NAMES)
    if unknown:
        raise ValueError(f"not step metrics: {', '.join(unknown)}")
    names = ("step", *[m for m in metrics if m != "step"])
    columns = [getattr(StepMetric, name) for name in names]
    query = select(*columns).where(StepMetric.run_id == run_id).order_by(StepMetric.step)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return {name: [row[i] for row in rows] for i, name in enumerate(names)}


def recent_imbalance(engine: Engine, run_id: int, windows: int = 3) -> list[float | None]:
    """A run's last `windows` report windows' imbalance (slowest rank's compute time over the
    fastest's), oldest first; None for a window that had none."""
    query = (select(StepMetric.imbalance).where(StepMetric.run_id == run_id)
             .order_by(StepMetric.step.desc()).limit(windows))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [row[0] for row in reversed(rows)]


def recent_steps(engine: Engine, run_id: int, limit: int = 200) -> list[tuple[int, Any]]:
    """A run's last `limit` logged steps as (step, time), oldest first (the (run_id, step)
    index reads them backwards): what the recent step rate is measured on."""
    query = (select(StepMetric.step, StepMetric.time).where(StepMetric.run_id == run_id)
             .order_by(StepMetric.step.desc()).limit(limit))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [(step, time) for step, time in reversed(rows)]


def run_rank_stats(engine: Engine, run_id: int) -> dict[str, list]:
    """One run's per-rank stats, column-wise (RANK_STAT_COLUMNS), ordered by step then rank."""
    columns = [getattr(RankStat, name) for name in RANK_STAT_COLUMNS]
    query = (select(*columns).where(RankStat.run_id == run_id)
             .order_by(RankStat.step, RankStat.rank))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    out = {name: [row[i] for row in rows] for i, name in enumerate(RANK_STAT_COLUMNS)}
    out["is_straggler"] = [bool(v) for v in out["is_straggler"]]
    return out


def rank_summary(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Per rank over the whole run: its device (at the latest step), steps logged, mean step
    and compute times, peak memory (None where never measured) and straggler steps."""
    straggled = func.sum(case((RankStat.is_straggler, 1), else_=0))
    query = (
        select(RankStat.rank, func.count().label("steps_logged"),
               func.avg(RankStat.step_time_s).label("mean_step_time_s"),
               func.avg(RankStat.compute_time_s).label("mean_compute_time_s"),
               func.max(RankStat.peak_memory_bytes).label("peak_memory_bytes"),
               straggled.label("straggler_steps"))
        .where(RankStat.run_id == run_id).group_by(RankStat.rank).order_by(RankStat.rank)
    )
    last_step = (select(func.max(RankStat.step)).where(RankStat.run_id == run_id)
                 .scalar_subquery())
    devices_query = select(RankStat.rank, RankStat.device).where(
        RankStat.run_id == run_id, RankStat.step == last_step)
    with engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
        devices = dict(conn.execute(devices_query).all())
    return [{"rank": r["rank"], "device": devices.get(r["rank"]),
             "steps_logged": r["steps_logged"], "mean_step_time_s": r["mean_step_time_s"],
             "mean_compute_time_s": r["mean_compute_time_s"],
             "peak_memory_bytes": r["peak_memory_bytes"],
             "straggler_steps": int(r["straggler_steps"] or 0)} for r in rows]


def rank_windows(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Every report window of every rank (WINDOW_COLUMNS), ordered by step then rank."""
    query = (select(*[getattr(RankStat, name) for name in WINDOW_COLUMNS])
             .where(RankStat.run_id == run_id).order_by(RankStat.step, RankStat.rank))
    with engine.connect() as conn:
        return [_window(row) for row in conn.execute(query).mappings()]


def latest_rank_window(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """Each rank's latest report window (WINDOW_COLUMNS), by rank; [] before the first."""
    last_step = (select(func.max(RankStat.step)).where(RankStat.run_id == run_id)
                 .scalar_subquery())
    query = (select(*[getattr(RankStat, name) for name in WINDOW_COLUMNS])
             .where(RankStat.run_id == run_id, RankStat.step == last_step)
             .order_by(RankStat.rank))
    with engine.connect() as conn:
        return [_window(row) for row in conn.execute(query).mappings()]


def run_events(engine: Engine, run_id: int) -> list[dict[str, Any]]:
    """What changed how a run trains (rebalanced, balance limited, continued on fewer devices),
    in step order: {"step", "time", "kind", "message", "details"} with details parsed."""
    query = (select(RunEvent.step, RunEvent.time, RunEvent.kind, RunEvent.message,
                    RunEvent.details_json)
             .where(RunEvent.run_id == run_id).order_by(RunEvent.step, RunEvent.id))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [{"step": step, "time": time, "kind": kind, "message": message,
             "details": _json_object(details)} for step, time, kind, message, details in rows]


def balanced_runs(engine: Engine, limit: int = 200) -> list[dict[str, Any]]:
    """Runs whose ranks trained on unequal shares: rebalanced at least once, or given unequal
    batch sizes in some report window. Newest first: {"id", "name", "status", "world_size",
    "rebalances"}. Runs without recorded shares (older rows) are not among them."""
    rebalances = (select(RunEvent.run_id, func.count().label("n"))
                  .where(RunEvent.kind == "rebalance").group_by(RunEvent.run_id).subquery())
    unequal = (select(RankStat.run_id).group_by(RankStat.run_id, RankStat.step)
               .having(func.max(RankStat.batch_size) > func.min(RankStat.batch_size)))
    query = (select(TrainingRun.id, TrainingRun.name, TrainingRun.status,
                    TrainingRun.world_size, func.coalesce(rebalances.c.n, 0).label("rebalances"))
             .outerjoin(rebalances, rebalances.c.run_id == TrainingRun.id)
             .where((rebalances.c.n > 0) | TrainingRun.id.in_(unequal))
             .order_by(TrainingRun.id.desc()).limit(limit))
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(query).mappings()]


def latest_evaluations(engine: Engine) -> dict[int, dict[str, Any]]:
    """Each run's latest evaluation (the highest id), by run id: {"fvu", "l0", "origin",
    "rows"}; None where a value was not measured. Runs without an evaluation are absent."""
    latest = (select(func.max(SaeEvaluation.id)).where(SaeEvaluation.run_id.is_not(None))
              .group_by(SaeEvaluation.run_id))
    query = (select(SaeEvaluation.run_id, SaeEvaluation.fvu, SaeEvaluation.l0,
                    SaeEvaluation.origin, SaeEvaluation.rows)
             .where(SaeEvaluation.id.in_(latest)))
    with engine.connect() as conn:
        return {row.run_id: {"fvu": row.fvu, "l0": row.l0, "origin": row.origin, "rows": row.rows}
                for row in conn.execute(query)}


def list_benchmarks(engine: Engine) -> list[dict[str, Any]]:
    """Every benchmark run (benchmark_runs rows), newest first."""
    with Session(engine) as s:
        runs = s.execute(select(BenchmarkRun).order_by(BenchmarkRun.id.desc())).scalars().all()
        return [r.model_dump() for r in runs]


def load_benchmark(engine: Engine, bench_id: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The benchmark's row and its points as plain dicts; a UserError names a missing id."""
    with Session(engine) as s:
        run = s.get(BenchmarkRun, bench_id)
        if run is None:
            raise UserError(f"no benchmark {bench_id} in {engine.url.render_as_string(hide_password=True)} "
                            "(python -m sae_dist bench prints the id of each one)")
        points = s.execute(select(BenchmarkPoint).where(BenchmarkPoint.bench_id == bench_id)
                           .order_by(BenchmarkPoint.devices, BenchmarkPoint.repeat)).scalars().all()
        return run.model_dump(), [p.model_dump() for p in points]


def _window(row) -> dict[str, Any]:
    window = dict(row)
    window["is_straggler"] = bool(window["is_straggler"])
    return window


def _summaries(engine: Engine, run_id: int | None, limit: int) -> list[dict[str, Any]]:
    # The latest logged step of each run, found through the (run_id, step) unique index.
    latest_step = (select(func.max(StepMetric.step)).where(StepMetric.run_id == TrainingRun.id)
                   .correlate(TrainingRun).scalar_subquery())
    query = (select(TrainingRun, StepMetric)
             .outerjoin(StepMetric, and_(StepMetric.run_id == TrainingRun.id,
                                         StepMetric.step == latest_step))
             .order_by(TrainingRun.id.desc()).limit(limit))
    if run_id is not None:
        query = query.where(TrainingRun.id == run_id)
    with Session(engine) as session:
        rows = session.execute(query).all()
        return [summarize_run(run, latest, with_config=run_id is not None) for run, latest in rows]


def summarize_run(run: TrainingRun, latest: StepMetric | None, *, with_config: bool) -> dict[str, Any]:
    """A run as plain data. Keys: id, name, status, architecture, world_size, backend,
    devices (list), host, job_id, run_dir, export_dir, total_steps, last_step, progress
    (0..1, None when total_steps is 0), created_at, started_at, finished_at, last_update
    (time of the latest logged step, None if none), error, final (bool: the metrics are
    the run's final ones), LATEST_METRICS (None where never measured), and the latest
    window's imbalance and balance_limited_rank (None where not recorded)."""
    summary: dict[str, Any] = {
        "id": run.id, "name": run.name, "status": run.status, "architecture": run.architecture,
        "world_size": run.world_size, "backend": run.backend, "devices": _devices(run.device_ids),
        "host": run.host, "job_id": run.job_id, "run_dir": run.run_dir,
        "export_dir": run.export_dir, "total_steps": run.total_steps,
        "last_step": run.last_step,
        "progress": min(run.last_step / run.total_steps, 1.0) if run.total_steps > 0 else None,
        "created_at": run.created_at, "started_at": run.started_at,
        "finished_at": run.finished_at,
        "last_update": latest.time if latest is not None else None,
        "error": run.error,
    }
    finals = {m: getattr(run, f"final_{m}") for m in LATEST_METRICS}
    summary["final"] = run.status == "COMPLETED" and any(v is not None for v in finals.values())
    for metric in LATEST_METRICS:
        value = finals[metric] if summary["final"] else None
        if value is None and latest is not None:
            value = getattr(latest, metric)
        summary[metric] = value
    # Load balance of the latest window; None on runs from before it was measured.
    summary["imbalance"] = latest.imbalance if latest is not None else None
    summary["balance_limited_rank"] = latest.balance_limited_rank if latest is not None else None
    summary["recovery_mean_cos"] = run.recovery_mean_cos
    summary["recovery_frac"] = run.recovery_frac
    if with_config:
        summary["config"] = _json_object(run.config_json)
    return summary


def _devices(device_ids: str) -> list[str]:
    try:
        value = json.loads(device_ids)
    except (TypeError, ValueError):
        return [device_ids] if device_ids else []
    return [str(d) for d in value] if isinstance(value, list) else [str(value)]


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object column (a config, an event's details); {} when unreadable."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


"""Synchronous reads and writes of training runs and their metrics (trainer rank 0, the app).

Small calls at the start and end of a run; the per-step stream goes through
`writer.DatabaseMetricsLogger` instead, so that training never waits on the database.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.schema import RUN_EVENT_KINDS, RankStat, RunEvent, StepMetric, TrainingRun


def check_fields(model: type, fields: dict[str, Any]) -> None:
    """Refuse names that are not columns of `model` (a typo must not vanish silently) and
    naive datetimes, with a plain ValueError before any SQL runs."""
    unknown = sorted(set(fields) - set(model.__table__.columns.keys()))
    if unknown:
        raise ValueError(f"not columns of {model.__tablename__}: {', '.join(unknown)}")
    for name, value in fields.items():
        if isinstance(value, datetime) and value.utcoffset() is None:
            raise ValueError(f"{name}: naive datetime {value!r}; use sae_dist.db.utcnow()")


def create_run(engine: Engine, **fields: Any) -> int:
    """Insert a training run; returns its id."""
    check_fields(TrainingRun, fields)
    run = TrainingRun(**fields)
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        session.commit()
        return run.id


def get_run(engine: Engine, run_id: int) -> TrainingRun | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(TrainingRun, run_id)


def find_run_by_dir(engine: Engine, run_dir: str) -> TrainingRun | None:
    """The latest run that used `run_dir` (a resumed run finds its earlier record)."""
    query = select(TrainingRun).where(TrainingRun.run_dir == run_dir)
    with Session(engine) as session:
        return session.scalars(query.order_by(TrainingRun.id.desc()).limit(1)).first()


def update_run_on(conn: Connection, run_id: int, fields: dict[str, Any]) -> None:
    """Update columns of one run inside the caller's transaction (shared with the writer)."""
    check_fields(TrainingRun, fields)
    result = conn.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(**fields))
    if result.rowcount == 0:
        raise LookupError(f"no training run with id {run_id}")


def update_run(engine: Engine, run_id: int, **fields: Any) -> None:
    with engine.begin() as conn:
        update_run_on(conn, run_id, fields)


def delete_metrics_after(engine: Engine, run_id: int, step: int) -> None:
    """Drop step metrics, rank stats and events past `step`: a resumed run recomputes them."""
    with engine.begin() as conn:
        for model in (StepMetric, RankStat, RunEvent):
            conn.execute(delete(model).where(model.run_id == run_id, model.step > step))


def step_metrics(engine: Engine, run_id: int) -> list[StepMetric]:
    query = select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.step)
    with Session(engine) as session:
        return list(session.scalars(query))


def rank_stats(engine: Engine, run_id: int) -> list[RankStat]:
    query = (
        select(RankStat).where(RankStat.run_id == run_id).order_by(RankStat.step, RankStat.rank)
    )
    with Session(engine) as session:
        return list(session.scalars(query))


def add_run_event(engine: Engine, run_id: int, step: int, kind: str, message: str, details: dict | None = None) -> None:
    if kind not in RUN_EVENT_KINDS:
        raise ValueError(f"run event kind {kind!r}: not one of {', '.join(RUN_EVENT_KINDS)}")
    with Session(engine) as session:
        session.add(RunEvent(run_id=run_id, step=step, kind=kind, message=message,
                             details_json=json.dumps(details or {})))
        session.commit()


def run_events(engine: Engine, run_id: int) -> list[RunEvent]:
    query = select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.step, RunEvent.id)
    with Session(engine) as session:
        return list(session.scalars(query))

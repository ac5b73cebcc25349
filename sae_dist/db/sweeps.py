"""Reads and writes of sweeps: one job's many SAEs trained from one activation stream.

The sweep's row holds what its SAEs share (run directory, swept keys, base config, placement);
each SAE is an ordinary training run naming its sweep and point, so every run view, metric and
export path works on it unchanged.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.runs import check_fields
from sae_dist.db.schema import SWEEP_STATUSES, Sweep, TrainingRun


def create_sweep(engine: Engine, **fields: Any) -> int:
    """Insert a sweep; returns its id."""
    check_fields(Sweep, fields)
    _check_status(fields)
    sweep = Sweep(**fields)
    with Session(engine, expire_on_commit=False) as session:
        session.add(sweep)
        session.commit()
        return sweep.id


def update_sweep(engine: Engine, sweep_id: int, **fields: Any) -> None:
    check_fields(Sweep, fields)
    _check_status(fields)
    with engine.begin() as conn:
        if conn.execute(update(Sweep).where(Sweep.id == sweep_id).values(**fields)).rowcount == 0:
            raise LookupError(f"no sweep with id {sweep_id}")


def get_sweep(engine: Engine, sweep_id: int) -> Sweep | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(Sweep, sweep_id)


def find_sweep_by_dir(engine: Engine, run_dir: str) -> Sweep | None:
    """The latest sweep that used `run_dir` (a resumed sweep finds its earlier record)."""
    query = select(Sweep).where(Sweep.run_dir == run_dir).order_by(Sweep.id.desc()).limit(1)
    with Session(engine, expire_on_commit=False) as session:
        return session.scalars(query).first()


def list_sweeps(engine: Engine, limit: int = 200) -> list[Sweep]:
    """The newest sweeps first."""
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(select(Sweep).order_by(Sweep.id.desc()).limit(limit)))


def sweep_runs(engine: Engine, sweep_id: int) -> list[TrainingRun]:
    """The training runs of a sweep's SAEs, in the order they were created (the sweep's order)."""
    query = select(TrainingRun).where(TrainingRun.sweep_id == sweep_id).order_by(TrainingRun.id)
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(query))


def _check_status(fields: dict[str, Any]) -> None:
    if "status" in fields and fields["status"] not in SWEEP_STATUSES:
        raise ValueError(f"sweep status {fields['status']!r}: one of {', '.join(SWEEP_STATUSES)}")

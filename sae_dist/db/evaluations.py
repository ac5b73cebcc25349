"""Reads and writes of SAE evaluations (the `evaluations` table): the trainer's held-out one at
the end of a run, and `python -m sae_dist evaluate`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.schema import EVALUATION_ORIGINS, SaeEvaluation, TrainingRun

_METRICS = ("fvu", "explained_variance", "mse", "cosine", "l0", "dead_fraction", "dense_fraction")


def _number(value: Any) -> float | None:
    # NaN and inf are stored as NULL (SQLite does so for NaN anyway; PostgreSQL would keep them).
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def record_evaluation(engine: Engine, evaluation: Any, sae_path: str | Path, data_path: str | Path,
                      run_id: int | None = None, where: str = "cli") -> int:
    """Insert one evaluation (a sae_dist.evaluate.Evaluation, or its to_dict()); returns its id.

    `where` is "heldout" (the trainer, on its held-out rows) or "cli" (the evaluate command)."""
    if where not in EVALUATION_ORIGINS:
        raise ValueError(f"where={where!r}: not one of {', '.join(EVALUATION_ORIGINS)}")
    d = evaluation if isinstance(evaluation, dict) else evaluation.to_dict()
    row = SaeEvaluation(
        run_id=run_id, sae_path=str(sae_path), data_path=str(data_path), rows=int(d["rows"]),
        **{name: _number(d.get(name)) for name in _METRICS},
        density_json=json.dumps(d["density"]),
        recovery_json=json.dumps(d["recovery"]) if d.get("recovery") is not None else None,
        model_check_json=json.dumps(d["model_check"]) if d.get("model_check") is not None else None,
        core_json=json.dumps(d["core"]) if d.get("core") else None,
        origin=where)
    with Session(engine, expire_on_commit=False) as session:
        session.add(row)
        session.commit()
        return row.id


def evaluations_for_run(engine: Engine, run_id: int) -> list[SaeEvaluation]:
    """A run's evaluations, oldest first."""
    query = select(SaeEvaluation).where(SaeEvaluation.run_id == run_id).order_by(SaeEvaluation.id)
    with Session(engine) as session:
        return list(session.scalars(query))


def latest_evaluation_for_run(engine: Engine, run_id: int) -> SaeEvaluation | None:
    query = select(SaeEvaluation).where(SaeEvaluation.run_id == run_id).order_by(SaeEvaluation.id.desc()).limit(1)
    with Session(engine) as session:
        return session.scalars(query).first()


def evaluation_dict(row: SaeEvaluation) -> dict[str, Any]:
    """A stored evaluation with its JSON columns parsed: the shape of Evaluation.to_dict() plus
    id, run_id, created_at, sae_path, data_path and where."""
    out: dict[str, Any] = {"id": row.id, "run_id": row.run_id, "created_at": row.created_at,
                           "sae_path": row.sae_path, "data_path": row.data_path, "where": row.origin,
                           "rows": row.rows}
    out.update({name: getattr(row, name) for name in _METRICS})
    out["density"] = json.loads(row.density_json)
    out["recovery"] = json.loads(row.recovery_json) if row.recovery_json else None
    out["model_check"] = json.loads(row.model_check_json) if row.model_check_json else None
    out["core"] = json.loads(row.core_json) if row.core_json else {}
    return out


def run_for_export(engine: Engine, sae_path: str | Path) -> int | None:
    """The id of the latest training run whose export is `sae_path` (its RUN_DIR/sae), or None.

    Runs store their directory as given to the trainer (relative or not), so both the path as
    given and resolved are tried, as the export_dir and as the run_dir's `sae` folder."""
    p = Path(sae_path)
    exports = {str(p), str(p.resolve()), str(p.absolute())}
    run_dirs = {str(Path(e).parent) for e in exports} if p.name == "sae" else set()
    clauses = [TrainingRun.export_dir.in_(exports)]
    if run_dirs:
        clauses.append(TrainingRun.run_dir.in_(run_dirs))
    query = select(TrainingRun.id).where(or_(*clauses)).order_by(TrainingRun.id.desc()).limit(1)
    with Session(engine) as session:
        return session.scalars(query).first()

"""A training run as one file to share or keep: its config, every logged step's metrics, its
events and its latest evaluation (JSON), and its SAELens export folder as a zip archive.

Built from the state database and the run's own folder, nothing else: the app offers both as
downloads on the Training runs page.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from sae_dist.analytics import queries
from sae_dist.analytics.evaluation_view import latest_evaluation

FORMAT = "sae-dist run 1"  # what a reader checks before it trusts the keys below


def run_record(engine: Engine, run_id: int) -> dict[str, Any] | None:
    """The run as plain data: {"format", "run" (its summary and config), "metrics" (column-wise,
    one entry per logged step), "events", "evaluation" (or None)}; None when there is no such run."""
    run = queries.get_run_summary(engine, run_id)
    if run is None:
        return None
    metrics = queries.run_step_metrics(engine, run_id)
    return {"format": FORMAT, "run": run, "metrics": metrics, "events": queries.run_events(engine, run_id),
            "evaluation": latest_evaluation(engine, run_id)}


def record_json(record: dict[str, Any]) -> str:
    """`run_record` as JSON text: times in ISO 8601, NaN and infinities as null (JSON has none)."""
    return json.dumps(_plain(record), indent=1, allow_nan=False) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sae_archive(export_dir: str | None) -> bytes | None:
    """The SAELens export folder as a zip (its files under the folder's name), or None when the
    run has none on this machine (not exported yet, or moved)."""
    if not export_dir or not Path(export_dir).is_dir():
        return None
    folder = Path(export_dir)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            archive.write(path, Path(folder.name) / path.relative_to(folder))
    return buffer.getvalue()


def file_stem(name: str, run_id: int) -> str:
    """A download's file name: the run's id and name, as one harmless path component."""
    from sae_dist.paths import safe_name

    return f"run-{run_id}-{safe_name(name)}"

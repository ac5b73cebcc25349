"""Per-step metrics written from a background thread, so that training never waits on SQLite.

The torchtitan metrics-logger shape: `log(metrics, step)` and `close()`. Calls only validate
and queue; a daemon thread writes the queue in batches, one transaction each. A write that
fails (database locked past the busy timeout) is retried at the next flush; the queue is
bounded, dropping its oldest rows with a warning rather than growing without limit.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, exc
from sqlalchemy.engine import Engine

from sae_dist.db.runs import check_fields, update_run_on
from sae_dist.db.schema import RUN_EVENT_KINDS, RankStat, RunEvent, StepMetric, TrainingRun, UTCDateTime, utcnow

logger = logging.getLogger(__name__)

_METRICS: Table = StepMetric.__table__
_RANKS: Table = RankStat.__table__
_EVENTS: Table = RunEvent.__table__


class DatabaseMetricsLogger:
    """Writes one run's step metrics and rank stats, and updates its row, in order."""

    def __init__(
        self,
        engine: Engine,
        run_id: int,
        *,
        flush_interval: float = 1.0,
        max_batch: int = 500,
        max_pending: int = 10_000,
        close_timeout: float = 60.0,
    ):
        self._engine = engine
        self._run_id = run_id
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._close_timeout = close_timeout
        self._pending: deque[tuple[int, str, dict[str, Any]]] = deque()  # (seq, kind, row)
        self._seq = 0
        self._dropped = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sae-dist-db-writer", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Queue one step_metrics row; keys are StepMetric column names (`time` defaults to now)."""
        row = _row(_METRICS, metrics, run_id=self._run_id, step=step, defaults={"time": utcnow()})
        self._enqueue([("metric", row)])

    def log_rank_stats(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Queue one rank_stats row per rank (keys: RankStat column names)."""
        rows = [
            _row(_RANKS, r, run_id=self._run_id, step=step, defaults={"is_straggler": False})
            for r in rows
        ]
        self._enqueue([("rank", r) for r in rows])

    def log_event(self, step: int, kind: str, message: str, details: dict[str, Any]) -> None:
        """Queue one run_events row (rebalanced, balance limited, continued on fewer devices)."""
        if kind not in RUN_EVENT_KINDS:
            raise ValueError(f"run event kind {kind!r}: not one of {', '.join(RUN_EVENT_KINDS)}")
        self._enqueue([("event", {"run_id": self._run_id, "step": int(step), "time": utcnow(), "kind": kind,
                                  "message": message, "details_json": json.dumps(details)})])

    def update_run(self, **fields: Any) -> None:
        """Queue an update of this run's training_runs row, applied in order with the rows."""
        check_fields(TrainingRun, fields)
        self._enqueue([("update", fields)])

    def close(self) -> None:
        """Write everything queued, then stop the thread. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify()
        self._thread.join(self._close_timeout + 60)  # + one busy timeout in progress
        if self._thread.is_alive():
            lost = len(self._pending)
            logger.warning("metrics writer still busy at close; %d rows may be lost", lost)

    def __enter__(self) -> DatabaseMetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _enqueue(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("DatabaseMetricsLogger is closed")
            for kind, row in items:
                self._seq += 1
                self._pending.append((self._seq, kind, row))
            while len(self._pending) > self._max_pending:
                self._pending.popleft()
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    logger.warning(
                        "database unwritable: dropped %d oldest metric rows so far", self._dropped
                    )
            if len(self._pending) >= self._max_batch:
                self._cond.notify()

    def _run(self) -> None:
        failed = False
        deadline = None
        while True:
            with self._cond:
                if failed or (not self._closing and len(self._pending) < self._max_batch):
                    self._cond.wait(self._flush_interval)
                closing = self._closing
            failed = not self._flush()
            if closing:
                deadline = deadline or time.monotonic() + self._close_timeout
                if not failed or time.monotonic() > deadline:
                    break
        if failed:
            lost = len(self._pending)
            logger.warning("metrics writer closing: %d rows could not be written", lost)

    def _flush(self) -> bool:
        """Write all pending rows, `max_batch` per transaction; False when one must be retried."""
        while True:
            with self._cond:
                batch = list(itertools.islice(self._pending, self._max_batch))
            if not batch:
                return True
            try:
                with self._engine.begin() as conn:
                    _write(conn, self._run_id, batch)
            except exc.OperationalError as error:  # locked, busy, connection lost: may pass
                pending = len(self._pending)
                logger.warning("metrics not written (%d pending), will retry: %s", pending, error)
                return False
            except Exception as error:  # the database refuses these rows: retrying cannot help
                logger.warning("dropping %d rows the database refused: %s", len(batch), error)
            with self._cond:  # drop what was handled (overflow may already have dropped some)
                while self._pending and self._pending[0][0] <= batch[-1][0]:
                    self._pending.popleft()


def _row(table: Table, values: dict[str, Any], *, run_id: int, step: int, defaults: dict) -> dict:
    """A complete, typed row (every column present, so rows batch into one executemany).

    Checked here, in the caller's thread, so that a mistake fails at once, not in the writer.
    """
    columns = {c.name: c for c in table.columns if c.name not in ("id", "run_id", "step")}
    unknown = sorted(set(values) - set(columns))
    if unknown:
        raise ValueError(f"not columns of {table.name}: {', '.join(unknown)}")
    row: dict[str, Any] = {"run_id": run_id, "step": int(step)}
    for name, column in columns.items():
        value = values.get(name, defaults.get(name))
        if value is None:
            if not column.nullable:
                raise ValueError(f"{table.name}: {name} is required")
        elif isinstance(column.type, UTCDateTime):
            if not isinstance(value, datetime):
                raise ValueError(f"{name}: needs a datetime, got {value!r}")
            if value.utcoffset() is None:
                raise ValueError(f"{name}: naive datetime {value!r}; use sae_dist.db.utcnow()")
        else:
            sql_type = getattr(column.type, "impl_instance", column.type)  # TypeDecorator's base
            value = sql_type.python_type(value)  # float(tensor), int(numpy int), ...
        row[name] = value
    return row


def _write(conn: Connection, run_id: int, batch: list[tuple[int, str, dict[str, Any]]]) -> None:
    """Write a batch in order, consecutive rows of one kind in one statement."""
    for kind, group in itertools.groupby(batch, key=lambda item: item[1]):
        rows = [row for _, _, row in group]
        if kind == "update":
            for fields in rows:
                update_run_on(conn, run_id, fields)
        elif kind == "metric":
            _upsert(conn, _METRICS, rows, ["run_id", "step"])
        elif kind == "event":
            conn.execute(_EVENTS.insert(), rows)
        else:
            _upsert(conn, _RANKS, rows, ["run_id", "step", "rank"])


def _upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], keys: list[str]) -> None:
    """Insert; a step logged again (a resumed run) replaces the earlier row."""
    if conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        conn.execute(table.insert(), rows)
        return
    stmt = insert(table)
    replace = {name: stmt.excluded[name] for name in rows[0] if name not in keys}
    stmt = stmt.on_conflict_do_update(index_elements=keys, set_=replace)
    conn.execute(stmt, rows)

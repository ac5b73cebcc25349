"""Every listing of the jobs table (the CLI's queue and acct, the app's job tables): one reader.

One SQL text, one column list and one decoding (JSON lists, 0/1 flags, UTC datetimes) into
one row type, `JobRow`, run on one of two connections:

- no engine given (the CLI): the default SQLite file opened read-only with the standard
  library. Importing SQLAlchemy and SQLModel costs a Python process ~0.4 s, more than a whole
  `queue` should take, so this module imports neither at load time. Anything unexpected
  (another database URL, a file not created or not migrated yet, a schema it cannot read)
  falls back to the regular engine, which also creates and migrates the database;
- an engine given (the app, `acct`): that engine, with the same SQL.

Writes, and reads that decide a write, go through `scheduler.store` (the SQLModel `Job`).
The job states and reason codes live next to the table, in `sae_dist.db.schema`.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import namedtuple
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sae_dist.paths import busy_timeout_pragma

if TYPE_CHECKING:
    from collections.abc import Iterable

COLUMNS = ("id", "name", "user", "kind", "state", "reason", "priority", "gpus", "held", "exclusive",
           "cancel_requested", "requeue_count", "time_limit_s", "devices_json", "gpu_ids_json",
           "submitted_at", "started_at", "ended_at", "exit_code", "signal", "stdout_path",
           "stderr_path", "workdir", "train_config_json", "array_job_id", "array_task_id", "array_max_running",
           "snapshot_commit", "preemptible", "attempts_json", "shared", "expected_start_at")
"""The columns of `jobs` a listing reads."""

ORDERS = {"id": '"id"', "newest": '"id" DESC', "last_ended": '"ended_at" DESC, "id" DESC'}
"""How a listing may be ordered: by id, newest first, or the last to end first."""


_FIELDS = tuple({"devices_json": "devices", "gpu_ids_json": "gpu_ids"}.get(c, c) for c in COLUMNS)
# SQLite gives 0/1
_FLAGS = [COLUMNS.index(c) for c in ("held", "exclusive", "cancel_requested", "preemptible", "shared")]
_LISTS = [COLUMNS.index(c) for c in ("devices_json", "gpu_ids_json")]
_TIMES = [COLUMNS.index(c) for c in ("submitted_at", "started_at", "ended_at", "expected_start_at")]


class JobRow(namedtuple("JobRow", _FIELDS)):
    """One job as listings show it: the columns of COLUMNS, decoded: flags are bools, times aware
    UTC datetimes, `devices` (the uuids it runs or ran on) and `gpu_ids` (the exact uuids it
    asked for) lists of strings. A named tuple: a dataclass would cost `queue` 15 ms of imports."""

    __slots__ = ()

    def train_config(self) -> dict[str, Any]:
        """The training config of a train job ({} for a command, or one that cannot be read)."""
        try:
            value = json.loads(self.train_config_json) if self.train_config_json else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict (the app's pages index jobs by column name)."""
        return self._asdict()


def read_jobs(engine=None, states: Iterable[str] | None = None, job_id: int | None = None,
              started_only: bool = False, order: str = "id", limit: int | None = None,
              job_ids: Iterable[int] | None = None, array_ids: Iterable[int] | None = None,
              pending_tasks: bool = True, names: Iterable[str] | None = None) -> list[JobRow]:
    """Jobs in `states` (None: every state), or the one with `job_id`, or those of `job_ids`
    and the tasks of the arrays `array_ids`; only those named one of `names`, when given; with
    `started_only`, only those that started; without `pending_tasks`, none of the arrays'
    pending tasks (see `pending_task_groups`); ordered by `order` (see ORDERS), at most `limit`.

    Without `engine`: the SQLite state file read directly, or the regular engine when that
    cannot answer."""
    sql, params = _query(states, job_id, started_only, order, limit, job_ids, array_ids, pending_tasks, names)
    return [_decode(row) for row in query(sql, params, engine)]


def pending_task_groups(engine=None, job_ids: Iterable[int] | None = None, array_ids: Iterable[int] | None = None,
                        names: Iterable[str] | None = None) -> dict[int, list[int]]:
    """The arrays' pending tasks as `queue` folds them, one group per array, reason and hold:
    the group's first job id -> its task ids, ascending; only those `read_jobs` would select
    with the same `job_ids`, `array_ids` and `names`. Reads five small columns, so a queue of
    30,000 pending tasks is not 30,000 decoded rows."""
    params: dict[str, Any] = {}
    where = ["\"state\" = 'PENDING'", '"array_job_id" IS NOT NULL', *_selection(job_ids, array_ids, names, params)]
    sql = ('SELECT "array_job_id", "reason", "held", "id", "array_task_id" FROM "jobs" '
           f'WHERE {" AND ".join(where)} ORDER BY "id"')
    rows = query(sql, params, engine)
    groups: dict[tuple, tuple[int, list[int]]] = {}
    for array_id, reason, held, job_id, task in rows:
        groups.setdefault((array_id, reason, bool(held)), (job_id, []))[1].append(task)
    return {first: sorted(tasks) for first, tasks in groups.values()}


def query(sql: str, params: dict[str, Any], engine=None) -> list:
    """Rows of one read-only query (named :parameters): without `engine`, on the SQLite state
    file read directly, else (or when that cannot answer) through the engine."""
    rows = _fetch_sqlite(sql, params) if engine is None else None
    return _fetch_engine(engine, sql, params) if rows is None else rows


def read_job(engine, job_id: int) -> JobRow | None:
    """One job, or None when there is no such job."""
    rows = read_jobs(engine, job_id=job_id)
    return rows[0] if rows else None


def read_allocations(engine=None) -> dict[int, list[str]]:
    """The devices each job holds now (job id -> uuids, in the order allocated)."""
    sql = 'SELECT "job_id", "device_uuid" FROM "allocations" WHERE "released_at" IS NULL ORDER BY "id"'
    rows = _fetch_sqlite(sql, {}) if engine is None else None
    if rows is None:
        rows = _fetch_engine(engine, sql, {})
    held: dict[int, list[str]] = {}
    for job_id, uuid in rows:
        held.setdefault(job_id, []).append(uuid)
    return held


def job_counts(engine=None) -> dict[tuple[str, str | None], int]:
    """How many jobs there are of each state, a pending job's also by its reason's code (the
    reason up to its first comma: "Resources, ExclusiveJob:3" counts as Resources; None while
    the daemon gave none), keyed (state, code); a job in any other state is keyed (state, None)."""
    sql = ('SELECT "state", CASE WHEN "state" = \'PENDING\' THEN "reason" END AS "why", count(*) '
           'FROM "jobs" GROUP BY "state", "why"')
    counts: dict[tuple[str, str | None], int] = {}
    for state, why, n in query(sql, {}, engine):
        key = (state, why.split(",", 1)[0].strip() if why else None)
        counts[key] = counts.get(key, 0) + n
    return counts


def has_cluster_jobs() -> bool | None:
    """Whether any job was handed to a SLURM cluster (so `queue` must ask SLURM); None: unknown."""
    path = sqlite_file()
    if path is None:
        return None
    if not path.is_file():
        return False
    rows = _fetch_sqlite('SELECT 1 FROM "cluster_jobs" LIMIT 1', {})
    return None if rows is None else bool(rows)


# ---- the query and its rows ----

MAX_ID = 2**63 - 1
"""No row has an id above SQLite's (and PostgreSQL's BIGINT) largest integer."""


def _ids_in(column: str, prefix: str, ids: Iterable[int], params: dict[str, Any]) -> str:
    """`"column" IN (:prefix0, ...)` for the ids a database can hold (NULL: none), its parameters added."""
    return _values_in(column, prefix, [x for x in sorted({int(i) for i in ids}) if 0 < x <= MAX_ID], params)


def _values_in(column: str, prefix: str, values: Iterable[Any], params: dict[str, Any]) -> str:
    """`"column" IN (:prefix0, ...)` (NULL: none), its parameters added."""
    names = {f"{prefix}{i}": value for i, value in enumerate(values)}
    params.update(names)
    return f'"{column}" IN ({", ".join(":" + n for n in names) or "NULL"})'


def _selection(job_ids: Iterable[int] | None, array_ids: Iterable[int] | None, names: Iterable[str] | None,
               params: dict[str, Any]) -> list[str]:
    """The WHERE terms for the jobs of `job_ids` and the tasks of the arrays `array_ids`, and for
    the jobs named one of `names` (None: no such term), their parameters added."""
    where = []
    if job_ids is not None or array_ids is not None:
        wanted = [_ids_in("id", "j", job_ids or (), params)]
        if array_ids is not None:
            wanted.append(_ids_in("array_job_id", "a", array_ids, params))
        where.append(f"({' OR '.join(wanted)})")
    if names is not None:
        where.append(_values_in("name", "n", names, params))
    return where


def _query(states: Iterable[str] | None, job_id: int | None, started_only: bool, order: str,
           limit: int | None, job_ids: Iterable[int] | None = None,
           array_ids: Iterable[int] | None = None, pending_tasks: bool = True,
           names: Iterable[str] | None = None) -> tuple[str, dict[str, Any]]:
    """The SQL text (quoted names: "user" is a keyword in PostgreSQL) and its named parameters."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; one of {', '.join(ORDERS)}")
    where, params = [], {}
    if states is not None:
        where.append(_values_in("state", "s", states, params))
    if job_id is not None:
        job_ids = [job_id]
    where += _selection(job_ids, array_ids, names, params)
    if started_only:
        where.append('"started_at" IS NOT NULL')
    if not pending_tasks:
        where.append("""NOT ("state" = 'PENDING' AND "array_job_id" IS NOT NULL)""")
    sql = f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in COLUMNS)} FROM "jobs"'
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY " + ORDERS[order]
    if limit is not None:
        sql += " LIMIT :limit"
        params["limit"] = int(limit)
    return sql, params


def _decode(row) -> JobRow:
    values = list(row)
    for i in _FLAGS:
        values[i] = bool(values[i])
    for i in _LISTS:
        values[i] = _json_list(values[i])
    for i in _TIMES:
        values[i] = _when(values[i])
    return JobRow._make(values)


def attempt_times(attempt: dict[str, Any]) -> tuple[datetime | None, datetime | None, float | None]:
    """(start, end, seconds between) of one of a job's earlier runs (an entry of its
    `attempts_json`, times as ISO text); None where a time is missing."""
    start, end = (datetime.fromisoformat(attempt[k]) if attempt.get(k) else None for k in ("started_at", "ended_at"))
    return start, end, (end - start).total_seconds() if start and end else None


def utc_time(value: str | datetime | None) -> datetime | None:
    """An aware UTC datetime from what a driver returns for a time column (SQLite: naive UTC
    text, PostgreSQL: a datetime)."""
    return _when(value)


def _when(value: str | datetime | None) -> datetime | None:
    """An aware UTC datetime from what a driver returns (SQLite: naive UTC text)."""
    if not value:
        return None
    if isinstance(value, str):
        tail = value[19:]  # after "YYYY-MM-DD HH:MM:SS": fractions, and an offset if any
        # naive UTC: 5x faster than .replace
        if len(value) >= 19 and "+" not in tail and "-" not in tail and "Z" not in tail:
            return datetime.fromisoformat(value + "+00:00")
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _json_list(text: str | None) -> list[str]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


# ---- the two connections ----

def sqlite_file() -> Path | None:
    """The default SQLite state file (as `sae_dist.paths.default_db_url` names it, without
    importing it), or None when the database is not a SQLite file."""
    url = os.environ.get("SAE_DIST_DB_URL")
    if url:
        return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
    home = Path(os.environ.get("SAE_DIST_HOME") or "~/.sae_dist").expanduser()
    return home / "state.db"


def _fetch_sqlite(sql: str, params: dict[str, Any]) -> list | None:
    """Rows of one read-only query on the SQLite state file, or None (no such file, or an error:
    the caller then takes the regular path)."""
    path = sqlite_file()
    if path is None or not path.is_file():
        return None
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error:
        return None
    try:
        con.execute(busy_timeout_pragma())
        return con.execute(sql, params).fetchall()
    except sqlite3.Error:
        return None
    finally:
        con.close()


def _fetch_engine(engine, sql: str, params: dict[str, Any]) -> list:
    from sqlalchemy import text

    if engine is None:
        from sae_dist.db import get_engine

        engine = get_engine()
    with engine.connect() as conn:
        return conn.execute(text(sql), params).all()

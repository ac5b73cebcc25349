"""`submit` in a few milliseconds: the job row inserted with the standard library's sqlite3.

Importing SQLAlchemy, SQLModel and the schema costs a Python process ~0.4 s, several times what
a whole `submit` may take (sweeps are submitted from shell loops). When the state database is a
SQLite file already migrated to the head revision (`sae_dist.paths.HEAD_REVISION`), in WAL
mode as the engine leaves it, the row `scheduler.newjob.job_row` builds is inserted here in one
`BEGIN IMMEDIATE` transaction, its dependencies checked in the same transaction, exactly as
`scheduler.store.submit` does. Anything else (PostgreSQL, no file yet, an older schema) returns
None and the caller takes the regular path, which creates and migrates the database.

Storage errors (locked, read-only, full) are raised as they are: the CLI turns them into one line.
"""

from __future__ import annotations

import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

from sae_dist.job_listing import sqlite_file
from sae_dist.paths import HEAD_REVISION, busy_timeout_pragma, busy_timeout_s
from scheduler.array_submit import jobs_to_store, task_rows
from scheduler.arrays import ArraySpec
from scheduler.newjob import check_dependencies_found
from scheduler.spec import JobSpec, check_memory_fits

SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"
"""How SQLAlchemy stores a DateTime in SQLite: naive UTC text with microseconds."""


def submit_quick(spec: JobSpec, now: datetime | None = None, array: ArraySpec | None = None,
                 overrides: list[dict] | None = None) -> int | None:
    """Queue `spec` (with `array`, one task per task id, see scheduler.array_submit) on the SQLite
    state file and wake or start the daemon; the job id (an array's id), or None when this path
    cannot take it (the caller then uses `scheduler.submit.submit_spec`)."""
    path = sqlite_file()
    if path is None or not path.is_file():
        return None
    con = _connect_at_head(path)
    if con is None:
        return None
    try:
        check_memory_fits(spec, device_totals(con))
        tasks = jobs_to_store(spec, machine_devices(con), array, overrides)
        job_id = _insert(con, task_rows(tasks, now or datetime.now(UTC), sqlite_values),
                         [dep_id for _, dep_id in tasks[0][1].dependencies], array is not None)
    finally:
        con.close()
    from scheduler.control import ensure_daemon

    ensure_daemon()
    return job_id


def _connect_at_head(path: Path) -> sqlite3.Connection | None:
    """A connection to a database at the head revision in WAL mode, else None."""
    con = sqlite3.connect(f"file:{quote(str(path))}?mode=rw", uri=True, timeout=busy_timeout_s(),
                          isolation_level=None)
    try:
        con.execute(busy_timeout_pragma())
        try:
            revision = con.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" not in str(e):
                raise
            revision = None
        if revision != (HEAD_REVISION,) or con.execute("PRAGMA journal_mode").fetchone() != ("wal",):
            con.close()
            return None
        con.execute("PRAGMA synchronous=NORMAL")
        con.execute("PRAGMA foreign_keys=ON")
        return con
    except BaseException:
        con.close()
        raise


def machine_devices(con: sqlite3.Connection) -> list[tuple[int, str]]:
    """This machine's devices as (index, uuid), as cheaply as they can be known truthfully:
    SAE_DIST_VIRTUAL_GPUS when set (the inventory would obey it first, and needs nothing else);
    else the daemon's `devices` table (it rewrites it every pass, removing devices that went);
    else, before any daemon ran, the live inventory (NVML, or the default virtual devices)."""
    from scheduler.devices import VIRTUAL_ENV_VAR, inventory, virtual_count, virtual_uuid

    if os.environ.get(VIRTUAL_ENV_VAR, "").strip():
        return [(i, virtual_uuid(i)) for i in range(virtual_count())]
    rows = con.execute('SELECT "index", "uuid" FROM "devices" ORDER BY "index"').fetchall()
    if rows:
        return [(int(index), str(uuid)) for index, uuid in rows]
    return [(d.index, d.uuid) for d in inventory({}, None)]


def device_totals(con: sqlite3.Connection) -> list[int | None]:
    """Each device's memory as the daemon last wrote it (none known before a daemon ran)."""
    return [row[0] for row in con.execute('SELECT "memory_total" FROM "devices"')]


def sqlite_values(row: dict) -> dict:
    """A job row's values as SQLAlchemy would bind them for SQLite: times as naive UTC text,
    flags as 0/1."""
    out = {}
    for key, value in row.items():
        if isinstance(value, datetime):
            value = value.astimezone(UTC).strftime(SQLITE_TIME_FORMAT)
        elif isinstance(value, bool):
            value = int(value)
        out[key] = value
    return out


def _insert(con: sqlite3.Connection, rows: list[dict], dependency_ids: list[int], as_array: bool) -> int:
    """Insert jobs in one transaction holding the write lock (their dependencies must exist); the
    first one's id. An array's tasks all get that id as their array's."""
    columns = ", ".join(f'"{k}"' for k in rows[0])
    sql = f'INSERT INTO "jobs" ({columns}) VALUES ({", ".join(":" + k for k in rows[0])})'
    con.execute("BEGIN IMMEDIATE")
    try:
        wanted = sorted(set(dependency_ids))
        if wanted:
            marks = ", ".join("?" for _ in wanted)
            check_dependencies_found(wanted, (r[0] for r in con.execute(
                f'SELECT "id" FROM "jobs" WHERE "id" IN ({marks})', wanted)))
        job_id = con.execute(sql, rows[0]).lastrowid
        if as_array:
            con.execute('UPDATE "jobs" SET "array_job_id" = ? WHERE "id" = ?', (job_id, job_id))
            for row in rows[1:]:
                row["array_job_id"] = job_id
        con.executemany(sql, rows[1:])
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    return int(job_id)

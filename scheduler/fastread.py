"""Read-only listings straight from SQLite, for a `queue` that answers as fast as squeue.

Importing SQLAlchemy and SQLModel costs a Python process ~0.4 s, more than the whole answer
should take. A listing only reads, so for the default SQLite database it opens the file
read-only with the standard library; anything unexpected (another database URL, a file not
created or not migrated yet, a schema it cannot read) returns None and the caller takes the
regular path, which also creates and migrates the database.
"""

from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

_DATETIMES = ("submitted_at", "started_at", "ended_at", "begin_at")


def sqlite_file() -> Path | None:
    url = os.environ.get("SAE_DIST_DB_URL")
    if url:
        return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
    home = Path(os.environ.get("SAE_DIST_HOME", "~/.sae_dist")).expanduser()
    return home / "state.db"


def _when(text: str | None) -> datetime | None:
    if not text:
        return None
    value = datetime.fromisoformat(text)
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _fetch(sql: str, params: tuple = (), as_dicts: bool = False) -> list | None:
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
        if as_dicts:
            con.row_factory = sqlite3.Row
        con.execute("PRAGMA busy_timeout=30000")
        return con.execute(sql, params).fetchall()
    except sqlite3.Error:
        return None
    finally:
        con.close()


def read_jobs(states: tuple[str, ...] | None) -> list[SimpleNamespace] | None:
    """Jobs (all, or in the given states) as attribute records, or None to use the regular path."""
    query = "SELECT * FROM jobs"
    params: tuple = ()
    if states is not None:
        query += f" WHERE state IN ({','.join('?' * len(states))})"
        params = states
    rows = _fetch(query + " ORDER BY id", params, as_dicts=True)
    if rows is None:
        return None
    out = []
    for row in rows:
        record = dict(row)
        for key in _DATETIMES:
            record[key] = _when(record.get(key))
        out.append(SimpleNamespace(**record))
    return out


def read_allocations() -> dict[int, list[str]] | None:
    """The devices each job holds now (job id -> uuids, in the order allocated), or None to use
    the regular path."""
    rows = _fetch("SELECT job_id, device_uuid FROM allocations WHERE released_at IS NULL ORDER BY id")
    if rows is None:
        return None
    held: dict[int, list[str]] = {}
    for job_id, uuid in rows:
        held.setdefault(job_id, []).append(uuid)
    return held


def has_cluster_jobs() -> bool | None:
    """Whether any job was handed to a SLURM cluster (so `queue` must ask SLURM); None: unknown."""
    path = sqlite_file()
    if path is None:
        return None
    if not path.is_file():
        return False
    rows = _fetch("SELECT 1 FROM cluster_jobs LIMIT 1")
    return None if rows is None else bool(rows)

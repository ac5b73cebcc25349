"""Facts about the state database that need no SQLAlchemy: its newest schema revision and how
long a connection waits for another writer's lock.

`sae_dist.db` migrates any database below the head revision; the scheduler's lean `submit`
(standard-library sqlite3) writes only to one already at it. Importing `sae_dist.db` costs
~0.4 s of SQLAlchemy, so these live in a leaf both can read (a test checks the revision
against Alembic's head, so it cannot go stale).
"""

from __future__ import annotations

import os

from sae_dist.errors import UserError

HEAD_REVISION = "0011"
"""The newest migration in sae_dist/db/migrations/versions/."""

BUSY_TIMEOUT_ENV = "SAE_DIST_DB_BUSY_TIMEOUT_S"
DEFAULT_BUSY_TIMEOUT_S = 30.0
MAX_BUSY_TIMEOUT_S = 3600.0


def busy_timeout_s() -> float:
    """How long a SQLite connection waits for a lock another process holds: $SAE_DIST_DB_BUSY_TIMEOUT_S
    (seconds), default 30. Past it the command reports the database as locked."""
    raw = os.environ.get(BUSY_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_BUSY_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_BUSY_TIMEOUT_S:  # NaN fails this too
        raise UserError(f"{BUSY_TIMEOUT_ENV}={raw!r}: give seconds from 0 to {MAX_BUSY_TIMEOUT_S:.0f}, "
                        f"or unset it for {DEFAULT_BUSY_TIMEOUT_S:.0f}")
    return value


def busy_timeout_pragma() -> str:
    return f"PRAGMA busy_timeout={int(busy_timeout_s() * 1000)}"

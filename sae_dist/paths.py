"""Where sae-dist keeps its state: one home directory (database, locks, logs, checkpoints), and
where a run writes (its run directory).

Every component asks here, so `SAE_DIST_HOME` and `SAE_DIST_DB_URL` mean the same thing
everywhere and tests can redirect all state to a temporary directory. Torch-free: the scheduler
and the app import it.

Also here, the facts about the state database that need no SQLAlchemy: its newest schema
revision and how long a connection waits for another writer's lock. `sae_dist.db` migrates any
database below the head revision; the scheduler's lean `submit` (standard-library sqlite3)
writes only to one already at it. Importing `sae_dist.db` costs ~0.4 s of SQLAlchemy, so both
read them here (a test checks the revision against Alembic's head, so it cannot go stale).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from sae_dist.errors import UserError

if TYPE_CHECKING:
    from sae_dist.config import TrainConfig


DB_URL_SCHEMES = ("sqlite://", "postgresql://", "postgresql+")  # SQLite, or PostgreSQL through a driver


def state_home() -> Path:
    """The state directory: `$SAE_DIST_HOME`, default `~/.sae_dist`; created on demand. A UserError
    when it cannot be (a file, a place nobody may write)."""
    raw = os.environ.get("SAE_DIST_HOME") or "~/.sae_dist"
    home = Path(raw).expanduser()
    if home.exists() and not home.is_dir():
        raise UserError(f"SAE_DIST_HOME={raw!r} is a file, not a directory; point it at a directory")
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"SAE_DIST_HOME={raw!r} cannot hold the state ({e.strerror or e}); "
                        "point it at a directory you may write") from None
    return home


def default_db_url() -> str:
    """The state database: `$SAE_DIST_DB_URL`, default a SQLite file in the state home."""
    url = os.environ.get("SAE_DIST_DB_URL")
    if url:
        if not url.startswith(DB_URL_SCHEMES):
            raise UserError(f"SAE_DIST_DB_URL={url!r} is not a database sae-dist can use: give "
                            "sqlite:////path/to/state.db or postgresql+psycopg://user@host/dbname")
        return url
    return f"sqlite:///{state_home() / 'state.db'}"


# ---- a run's directory (torch-free: the Train page and the launcher check it before any rank) ----


def safe_name(name: str) -> str:
    """A run name as one harmless path component (names are stored literally elsewhere)."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "run"
    return clean[:120]


def default_run_name(cfg: TrainConfig, saes: int | None = None, now: datetime | None = None) -> str:
    """A run without --name: its architecture, width and start time ("topk-4096-20261127-071800"),
    or for a sweep of `saes` SAEs "sweep8-<time>". The one rule: the trainer and the Train page
    (which names a job and its run alike at submit) both ask here."""
    stamp = f"{now or datetime.now():%Y%m%d-%H%M%S}"
    return f"sweep{saes}-{stamp}" if saes else f"{cfg.architecture}-{cfg.resolved_d_sae}-{stamp}"


def run_dir_for(cfg: TrainConfig) -> tuple[str, Path]:
    """(run name, run directory) of a config (sae_dist.train.checkpoint.check_run_dir also checks
    that the directory fits)."""
    name = cfg.name or default_run_name(cfg)
    return name, run_dir_of(name, cfg.out_dir)


def run_dir_of(name: str | None, out_dir: str | None) -> Path:
    """Where a run writes: its --out-dir (relative to where it runs), else the state home's
    runs/<name>."""
    return Path(out_dir).expanduser() if out_dir else state_home() / "runs" / safe_name(name)


# ---- the state database, without SQLAlchemy ----

HEAD_REVISION = "0017"
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

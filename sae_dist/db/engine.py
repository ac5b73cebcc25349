"""Connections to the state database: one engine per URL per process, set up for concurrency.

Several processes (daemon, supervisors, trainer rank 0, the app) write the same SQLite file,
so every connection gets WAL, a busy timeout and foreign keys, and transactions are real
(`BEGIN IMMEDIATE` possible). Migrations run on first use; Alembic is imported only then,
so the scheduler CLI starts fast.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, event, exc
from sqlalchemy.engine import Connection, Engine, make_url

from sae_dist.errors import UserError
from sae_dist.paths import HEAD_REVISION, busy_timeout_pragma, default_db_url, state_home  # HEAD_REVISION: re-exported

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlmodel import Session

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

SQLITE_PRAGMAS = (  # after busy_timeout_pragma(): the journal_mode switch may have to wait
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA foreign_keys=ON",
)
NFS_TYPES = {"nfs", "nfs4"}

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def get_engine(url: str | None = None) -> Engine:
    """The engine for `url` (default: the state database), migrated to the newest schema."""
    url = url or default_db_url()
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _create_engine(url)
            if _current_revision(engine) != HEAD_REVISION:
                _migrate(engine)
            _engines[url] = engine
    return engine


WRITE_LOCK_KEY = 0x5AED157  # PostgreSQL advisory lock id of immediate_transaction ("sae-dist")


@contextmanager
def immediate_transaction(engine: Engine) -> Iterator[Connection]:
    """A connection inside a transaction that holds the write lock from its start.

    On SQLite this is `BEGIN IMMEDIATE`: a select-then-update (job claim, device allocation)
    cannot interleave with another writer. On PostgreSQL the same guarantee comes from one
    transaction-scoped advisory lock that every such transaction takes first (released at commit).
    """
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.execution_options(sqlite_begin="BEGIN IMMEDIATE")
        with conn.begin():
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")
            yield conn


@contextmanager
def write_session(engine: Engine) -> Iterator[Session]:
    """An ORM session for a read-then-write, inside immediate_transaction (committed on leaving).

    A plain session's deferred transaction reads from a snapshot; if another process commits
    before its first write, SQLite in WAL mode cannot move the snapshot forward and the write fails
    at once with "database is locked" (the busy timeout does not apply). Taking the write lock first
    makes the other writer wait instead. `session.commit()` inside only flushes: the transaction
    commits when the block ends.
    """
    from sqlmodel import Session

    with immediate_transaction(engine) as conn, Session(bind=conn, expire_on_commit=False) as session:
        yield session
        session.flush()


def filesystem_type(path: str | os.PathLike[str], mounts_text: str) -> str | None:
    """The type of the filesystem holding `path`, from /proc/mounts text (longest mount prefix)."""
    target = PurePosixPath(path)
    best, best_type = -1, None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts escapes spaces and friends as octal (\040).
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        if target.is_relative_to(mount_point) and len(mount_point) > best:
            best, best_type = len(mount_point), fields[2]
    return best_type


def _refuse_nfs(directory: Path) -> None:
    """SQLite and file locks do not exclude across NFS clients: refuse such a directory."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:  # not Linux: nothing to check against
        return
    fstype = filesystem_type(directory.resolve(), mounts)
    if fstype in NFS_TYPES:
        raise UserError(
            f"the state database directory {directory} is on NFS ({fstype}), where SQLite "
            "locking is unreliable; set SAE_DIST_HOME to a local directory, or SAE_DIST_DB_URL "
            "to a PostgreSQL database"
        )


def _create_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    database = parsed.database or ""
    if database and database != ":memory:" and not database.startswith("file:"):
        directory = Path(database).expanduser().parent
        directory.mkdir(parents=True, exist_ok=True)
        _refuse_nfs(directory)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        # Stop pysqlite from managing transactions itself (it defers BEGIN until the first
        # write, which makes BEGIN IMMEDIATE impossible); we emit BEGIN in _on_begin.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        for pragma in (busy_timeout_pragma(), *SQLITE_PRAGMAS):
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(conn.get_execution_options().get("sqlite_begin", "BEGIN"))

    return engine


def _current_revision(engine: Engine) -> str | None:
    """The database's schema revision, or None when it has none yet (one cheap query)."""
    with engine.connect() as conn:
        try:
            return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
        except (exc.OperationalError, exc.ProgrammingError):  # no such table: a new database
            return None


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration for our migrations, without an ini file; runs on `connection`."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["connection"] = connection
    return config


def _migrate(engine: Engine) -> None:
    """Upgrade to the newest schema, one process at a time (the others wait, then see it done)."""
    from alembic import command
    from alembic.util import CommandError
    from filelock import FileLock

    with FileLock(str(state_home() / "migrate.lock")):
        if _current_revision(engine) == HEAD_REVISION:
            return
        with engine.connect() as conn:
            sqlite = engine.dialect.name == "sqlite"
            if sqlite:
                # A batch migration drops and recreates tables: with foreign keys on, dropping
                # training_runs would cascade-delete every metric. The pragma is a no-op inside
                # a transaction, so set it on the raw connection before BEGIN.
                conn.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
            try:
                with conn.begin():
                    command.upgrade(alembic_config(conn), "head")
                    if sqlite and conn.exec_driver_sql("PRAGMA foreign_key_check").first():
                        raise RuntimeError("migration left rows violating foreign keys")
            except CommandError as error:  # e.g. a revision from a newer sae-dist
                raise UserError(
                    f"cannot upgrade the state database {engine.url!r}: {error}; "
                    "is it used by a newer sae-dist?"
                ) from error
            finally:
                if sqlite:
                    conn.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


def _forget_engines_after_fork() -> None:
    # A forked child must not reuse the parent's pooled connections (fresh pools, same
    # engines), nor inherit the lock held by a parent thread that did not fork.
    global _engines_lock
    _engines_lock = threading.Lock()
    for engine in _engines.values():
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_engines_after_fork)

"""The one place that turns a storage fault into the line a person reads.

A command can meet the state database locked past the busy timeout, read-only (its files, its
directory or the filesystem), on a full disk or past a file-size limit, or unreadable. Whatever
raised it (sqlite3, SQLAlchemy wrapping a driver's error, or the operating system for a lock,
log or pid file), the CLI prints one line that names the problem and the state directory and
exits 1; each command's writes are single transactions, so nothing is stored half.
Pure: `storage_problem` maps an exception to words and imports no database code.
"""

from __future__ import annotations

import errno
import os
import sqlite3

_OS_PROBLEMS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "a file-size limit was reached",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}

_DRIVER_ERRORS = ("OperationalError", "DatabaseError", "InterfaceError")  # any driver's (DB-API names)


def storage_problem(error: BaseException, busy_timeout_s: float | None = None, free_bytes: int | None = None,
                    file_size_limit: int | None = None, ran_s: float | None = None) -> str | None:
    """What went wrong with the storage, in words, or None when `error` is no storage fault
    (a bug, which should surface as one). SQLAlchemy's errors are judged by the driver's
    error they wrap. SQLite says only "disk I/O error" for a failed write: the free space of
    the state directory and the process's file-size limit (None: unknown, unlimited) tell
    which it was. `ran_s`, how long the command had run: a lock error before the busy timeout
    could have passed is SQLite giving up at once (a deadlock it detects), not a long wait."""
    cause = getattr(error, "orig", None)
    if isinstance(cause, BaseException):
        error = cause
    if isinstance(error, OSError):
        text = _OS_PROBLEMS.get(error.errno)
        if text is None:
            return None
        return f"{text} ({error.filename})" if error.filename else text
    if isinstance(error, sqlite3.OperationalError) or type(error) is sqlite3.DatabaseError:
        problem = _sqlite_problem(str(error), busy_timeout_s, ran_s)
        if problem.startswith(("a write failed", "the disk is full")):
            if free_bytes == 0:
                return "the disk is full (0 bytes free)"
            if file_size_limit is not None:
                return f"a write failed: this process may write files of at most {file_size_limit} bytes (ulimit -f)"
        return problem
    if type(error).__name__ in _DRIVER_ERRORS and not isinstance(error, sqlite3.Error):
        return (f"the database refused: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}")
    return None


def _sqlite_problem(message: str, busy_timeout_s: float | None, ran_s: float | None = None) -> str:
    text = message.lower()
    if "locked" in text or "busy" in text:
        if busy_timeout_s is not None and ran_s is not None and ran_s < busy_timeout_s:
            return (f"it is locked by another process (SQLite gave up after {ran_s:.1f} s, before its "
                    f"{busy_timeout_s:g} s busy timeout: SQLite's {message!r}); try again")
        waited = f"waited {busy_timeout_s:g} s; " if busy_timeout_s is not None else ""
        return (f"it is locked by another process ({waited}SAE_DIST_DB_BUSY_TIMEOUT_S sets how long "
                "to wait); try again when that process is done")
    if "readonly" in text or "read-only" in text:
        return "it is read-only (its files or their directory cannot be written)"
    if "full" in text:
        return "the disk is full"
    if "disk i/o error" in text:
        return "a write failed (disk I/O error: a full disk or a file-size limit)"
    if "unable to open" in text:
        return "it cannot be opened (no permission, or its directory is gone)"
    if "malformed" in text or "not a database" in text:
        return "it is damaged or not a SQLite database"
    return f"SQLite: {message}"


def state_location() -> str:
    """The state directory as a person would look for it (the database URL when it is not a
    SQLite file), read from the environment without creating anything."""
    url = os.environ.get("SAE_DIST_DB_URL")
    if url and not url.startswith("sqlite:///"):
        return _without_password(url)
    if url:
        return os.path.dirname(url[len("sqlite:///"):]) or "."
    return os.path.expanduser(os.environ.get("SAE_DIST_HOME") or "~/.sae_dist")


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def storage_line(error: BaseException, busy_timeout_s: float | None = None, ran_s: float | None = None) -> str | None:
    """The one line to print for a storage fault, or None when `error` is not one."""
    where = state_location()
    problem = storage_problem(error, busy_timeout_s, *_disk_facts(where), ran_s=ran_s)
    if problem is None:
        return None
    return f"error: the state database in {where}: {problem}"


def _disk_facts(directory: str) -> tuple[int | None, int | None]:
    """(bytes free to us in `directory`, this process's file-size limit); None where unknown
    or unlimited."""
    import resource

    try:
        stats = os.statvfs(directory)
        free = stats.f_bavail * stats.f_frsize
    except OSError:
        free = None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return free, None if soft == resource.RLIM_INFINITY else soft

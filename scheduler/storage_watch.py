"""Whether the SQLite database a supervisor started with is still the one at its path.

`rm -r` of the state home (a reset) under a running job leaves its supervisor talking to a
database that no longer exists: it retried the job's end every 30 s for as long as it lived. Once
a new daemon has made the home again, the new database's job of the same id is another job,
whose cancel it would have obeyed. The watch holds the database's directory open, so a directory
made again at the path can never reuse its inode and pass for it; the database file's own inode
is compared too (a file is not held open: closing a second descriptor of a SQLite file would drop
the locks SQLite holds on it in this process).
"""

from __future__ import annotations

import os
from pathlib import Path


class DatabaseWatch:
    """`lost()` is True once the SQLite file (or its directory) was removed or replaced. A
    database that is not a SQLite file is never lost to this watch (a server outlives any
    directory), nor one it could not look at when it started. The directory stays open for as
    long as the process (a supervisor) lives."""

    def __init__(self, path: Path | None):
        self.path = path
        self._dir_fd: int | None = None
        self._file: tuple[int, int] | None = None
        if path is None:
            return
        try:
            self._file = _identity(os.stat(path))
            self._dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # not there to look at: lost() has no evidence either way
            pass

    @classmethod
    def of(cls, engine) -> "DatabaseWatch":
        url = engine.url
        local = url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:")
        return cls(Path(url.database).absolute() if local else None)

    def lost(self) -> bool:
        if self._dir_fd is None or self._file is None:
            return False
        try:
            directory, file = os.stat(self.path.parent), os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:  # unreadable for now (permissions, I/O): not evidence that it is gone
            return False
        return _identity(directory) != _identity(os.fstat(self._dir_fd)) or _identity(file) != self._file


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino

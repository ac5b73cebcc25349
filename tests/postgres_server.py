"""A throwaway PostgreSQL server on loopback for the tests: initdb into a temporary directory, a
free port on 127.0.0.1, trust authentication, no fsync; stopped by its process id."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def why_not_available() -> str | None:
    """None when a server can be started here, else the reason."""
    if postgres_bin() is None:
        return "PostgreSQL's server is not installed (Debian package postgresql)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "there is no 'postgres' user to run the server as"
    if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != "postgres":
        return "starting the server as the postgres user needs root here"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e .[postgres])"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="sae-dist-pg-"))
        self.port = _free_port()
        self.pid: int | None = None

    def _as_postgres(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *argv], check=True, capture_output=True, text=True, **kw)

    def start(self) -> PostgresServer:
        os.chmod(self.dir, 0o755)
        shutil.chown(self.dir, "postgres")
        data = self.dir / "data"
        self._as_postgres(str(self.bin / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                          "--no-locale", "--no-sync", timeout=120)
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c full_page_writes=off "
                   f"-c synchronous_commit=off -c max_connections=200")
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "server.log"), "-w",
                          "-o", options, "start", timeout=120)
        self.pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        return self

    def create_database(self, name: str) -> str:
        """A new empty database; its SQLAlchemy URL."""
        self._as_postgres(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                          name, timeout=60)
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)  # fast shutdown
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    os.kill(self.pid, 0)
                    time.sleep(0.1)
            except ProcessLookupError:
                pass
            self.pid = None
        shutil.rmtree(self.dir, ignore_errors=True)
